"""TVQ lookup matmul: the compiled lookup-GEMV (CPU), the Triton one (GPU) or the fp32 reference.

``VLLMEXT_KERNELS_FORCE_REF=1`` makes :func:`tvq_matmul` always use the reference.
"""

from __future__ import annotations

import os

import torch

from vllm_ext.kernels.tvq_gemv.ops import load, tvq_gemv
from vllm_ext.kernels.tvq_gemv.ref import dequantize_shards, tvq_matmul_ref
from vllm_ext.kernels.tvq_gemv.triton import triton_usable, tvq_gemv_triton

__all__ = ["dequantize_shards", "kernel_available", "tvq_gemv", "tvq_matmul", "tvq_matmul_ref"]


def kernel_available() -> bool:
    return os.environ.get("VLLMEXT_KERNELS_FORCE_REF") != "1" and load()


def tvq_matmul(x: torch.Tensor, codes, codebook, scale, shard_rows) -> torch.Tensor:
    if x.device.type == "cpu" and kernel_available():
        return tvq_gemv(x, codes, codebook, scale, shard_rows)
    if x.device.type == "cuda" and triton_usable():
        return tvq_gemv_triton(x, codes, codebook, scale, shard_rows)
    return tvq_matmul_ref(x, codes, codebook, scale, shard_rows)
