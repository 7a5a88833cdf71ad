"""Write a pruned model as a sparse checkpoint vLLM loads, and read one back into torch.

The folder (:mod:`vllm_ext.common.checkpoint`) holds every pruned linear as values +
indices (:mod:`.sparse_format`), the rest bf16.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from vllm_ext.common.checkpoint import (
    load_dense_reference,
    plain_tensors,
    tie_word_embeddings,
    write_checkpoint,
)
from vllm_ext.etaps.model_io import prunable_linears
from vllm_ext.etaps.sparse_format import SparseFormat, compact
from vllm_ext.kernels.sparse_gemv.ref import densify_ref


def export(model: nn.Module, base_dir: Path, out_dir: Path, sparsity: float) -> Path:
    """Save ``model`` (HF causal LM, decoder linears pruned per row) to ``out_dir``."""
    sparse = list(prunable_linears(model))
    return export_state(model.state_dict(), sparse, base_dir, out_dir, sparsity)


def export_state(
    state: dict[str, torch.Tensor], sparse: list[str], base_dir: Path, out_dir: Path,
    sparsity: float,
) -> Path:  # fmt: skip
    """Save a state dict whose linears ``sparse`` hold row-pruned ``<name>.weight``.

    (:meth:`StagedPruner.export_state` gives one mid-run, without touching the pruner.)
    """
    fmt = SparseFormat(sparsity)
    skip = {f"{name}.weight" for name in sparse}
    tensors = plain_tensors(state, skip, tie_word_embeddings(base_dir))
    for name in sparse:
        w = state[f"{name}.weight"].detach().float()
        tensors[f"{name}.values"], tensors[f"{name}.indices"] = compact(w, fmt.nnz(w.shape[1]))
    return write_checkpoint(base_dir, out_dir, tensors, fmt.to_dict())


def _densify(tensors: dict[str, torch.Tensor], base: str, linear: nn.Module) -> torch.Tensor:
    return densify_ref(tensors[f"{base}.values"], tensors[f"{base}.indices"], linear.in_features)


def load_reference(ckpt_dir: Path, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The checkpoint as a plain HF model with every sparse weight densified (the masked dense)."""
    return load_dense_reference(ckpt_dir, ".values", (".indices",), _densify, dtype)
