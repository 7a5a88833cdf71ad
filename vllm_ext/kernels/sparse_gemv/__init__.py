"""Row-sparse GEMV/GEMM (ETAPS checkpoints): compiled CPU kernel, Triton (CUDA) or the reference.

``VLLMEXT_KERNELS_FORCE_REF=1``, a failed build or no Triton selects :func:`.ref.sparse_gemm_ref`.
"""

from __future__ import annotations

import os

import torch

from vllm_ext.kernels.sparse_gemv.ref import densify_ref, sparse_gemm_ref
from vllm_ext.kernels.sparse_gemv.triton import sparse_gemm_triton, triton_usable

__all__ = [
    "compiled_available", "densify_ref", "kernel_available", "sparse_gemm", "sparse_gemm_ref",
]  # fmt: skip


def compiled_available() -> bool:
    if os.environ.get("VLLMEXT_KERNELS_FORCE_REF") == "1":
        return False
    try:
        from vllm_ext.kernels.sparse_gemv import ops

        ops.load()
    except Exception:  # no compiler or headers: the reference still serves
        return False
    return True


def kernel_available(device_type: str) -> bool:
    """Whether a sparse kernel serves tensors on ``device_type`` (``"cpu"``, ``"cuda"``, ...)."""
    if device_type == "cpu":
        return compiled_available()
    return device_type == "cuda" and triton_usable()


def sparse_gemm(x: torch.Tensor, values: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``[M, K] × row-sparse [N, K] → [M, N]`` (see :mod:`.ref`)."""
    if x.device.type == "cpu" and compiled_available():
        from vllm_ext.kernels.sparse_gemv import ops

        return ops.sparse_gemm(x, values, indices)
    if x.device.type == "cuda" and triton_usable():
        return sparse_gemm_triton(x, values, indices)
    return sparse_gemm_ref(x, values, indices)
