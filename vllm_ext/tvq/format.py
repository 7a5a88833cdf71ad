"""The TVQ checkpoint format: ``quantization_config`` and per-linear tensor names.

A quantized linear ``<name>`` is stored as ``<name>.codes`` ([rows, in/D],
uint8 when K <= 256 else int32), ``<name>.codebook`` ([K, D]) and
``<name>.scale`` ([rows, 1]), beside the model's other bf16 tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

METHOD = "tvq"
TENSORS = ("codes", "codebook", "scale")


@dataclass(frozen=True)
class QuantFormat:
    vec_dim: int
    num_codewords: int
    # name suffixes of the quantized modules as vLLM names them (fused names included)
    modules: tuple[str, ...] = ("mlp.gate_proj", "mlp.up_proj", "mlp.gate_up_proj",
                                "mlp.down_proj")  # fmt: skip

    @property
    def code_dtype(self) -> torch.dtype:
        return torch.uint8 if self.num_codewords <= 256 else torch.int32

    def covers(self, prefix: str) -> bool:
        return any(prefix == m or prefix.endswith("." + m) for m in self.modules)

    def to_dict(self) -> dict[str, Any]:
        return {"quant_method": METHOD, "vec_dim": self.vec_dim,
                "num_codewords": self.num_codewords, "modules": list(self.modules)}  # fmt: skip

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> QuantFormat:
        try:
            vec_dim, k = int(config["vec_dim"]), int(config["num_codewords"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"tvq quantization_config needs integer vec_dim and "
                             f"num_codewords, got {config!r}") from exc  # fmt: skip
        if vec_dim < 1 or not 2 <= k <= 2**31 - 1:
            raise ValueError(f"tvq quantization_config: bad vec_dim={vec_dim} or K={k}")
        modules = tuple(config.get("modules", cls.modules))
        return cls(vec_dim, k, modules)
