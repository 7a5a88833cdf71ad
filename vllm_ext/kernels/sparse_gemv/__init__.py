"""Row-sparse GEMV/GEMM (ETAPS checkpoints): compiled CPU kernel, or the torch reference.

``VLLMEXT_KERNELS_FORCE_REF=1`` or a failed build selects :func:`.ref.sparse_gemm_ref`.
"""

from __future__ import annotations

import os

import torch

from vllm_ext.kernels.sparse_gemv.ref import densify_ref, sparse_gemm_ref

__all__ = ["compiled_available", "densify_ref", "sparse_gemm", "sparse_gemm_ref"]


def compiled_available() -> bool:
    if os.environ.get("VLLMEXT_KERNELS_FORCE_REF") == "1":
        return False
    try:
        from vllm_ext.kernels.sparse_gemv import ops

        ops.load()
    except Exception:  # no compiler or headers: the reference still serves
        return False
    return True


def sparse_gemm(x: torch.Tensor, values: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``[M, K] × row-sparse [N, K] → [M, N]`` (see :mod:`.ref`)."""
    if x.device.type == "cpu" and compiled_available():
        from vllm_ext.kernels.sparse_gemv import ops

        return ops.sparse_gemm(x, values, indices)
    return sparse_gemm_ref(x, values, indices)
