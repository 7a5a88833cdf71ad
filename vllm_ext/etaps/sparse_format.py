"""The ETAPS sparse checkpoint format: ``quantization_config`` and the compact tensors.

A sparse linear ``<name>`` is stored as ``<name>.values`` ([rows, nnz] bf16) and
``<name>.indices`` ([rows, nnz] int16, the column of each kept weight, sorted),
beside the model's other bf16 tensors. Every row keeps the same
``nnz = in_features - pruned_per_row(in_features, sparsity)`` (the pruners cut
per row), so fused q/k/v and gate/up shards stack into one ``[rows, nnz]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vllm_ext.etaps.schedule import pruned_per_row

METHOD = "etaps"
TENSORS = ("values", "indices")
MAX_IN_FEATURES = 32767  # int16 column indices


@dataclass(frozen=True)
class SparseFormat:
    sparsity: float
    # name suffixes of the sparse modules as vLLM names them (fused names included)
    modules: tuple[str, ...] = (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.qkv_proj",
        "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.gate_up_proj", "mlp.down_proj",
    )  # fmt: skip

    def __post_init__(self) -> None:
        if not 0.0 < self.sparsity < 1.0:
            raise ValueError(f"etaps quantization_config: sparsity must be in (0, 1), "
                             f"got {self.sparsity}")  # fmt: skip

    def nnz(self, in_features: int) -> int:
        return in_features - pruned_per_row(in_features, self.sparsity)

    def covers(self, prefix: str) -> bool:
        return any(prefix == m or prefix.endswith("." + m) for m in self.modules)

    def to_dict(self) -> dict[str, Any]:
        return {"quant_method": METHOD, "sparsity": self.sparsity, "modules": list(self.modules)}

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> SparseFormat:
        try:
            sparsity = float(config["sparsity"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"etaps quantization_config needs a number 'sparsity', "
                             f"got {config!r}") from exc  # fmt: skip
        return cls(sparsity, tuple(config.get("modules", cls.modules)))


def compact(weight: torch.Tensor, nnz: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values bf16, indices int16)`` of a row-pruned ``[rows, in]`` weight.

    A row with fewer than ``nnz`` non-zeros (a kept weight that is exactly 0) is
    padded with zero-valued columns, so the product is unchanged.

    Raises:
        ValueError: a row has more than ``nnz`` non-zeros (not pruned to the sparsity),
        or ``in_features`` does not fit int16 indices.
    """
    rows, in_features = weight.shape
    if in_features > MAX_IN_FEATURES:
        raise ValueError(f"in_features {in_features} > {MAX_IN_FEATURES}: int16 indices")
    nonzero = weight != 0
    most = int(nonzero.sum(1).max()) if rows else 0
    if most > nnz:
        raise ValueError(f"a row keeps {most} weights but the format keeps {nnz} per row: "
                         "the weight is not pruned to the checkpoint's sparsity")  # fmt: skip
    # non-zeros first (ties among zeros: the lowest columns), then columns in order
    order = nonzero.float() * 2 - torch.arange(in_features, device=weight.device) / (
        2 * in_features
    )
    indices = torch.topk(order, nnz, dim=1).indices.sort(dim=1).values
    values = torch.gather(weight, 1, indices)
    return values.to(torch.bfloat16).cpu().contiguous(), indices.to(torch.int16).cpu().contiguous()
