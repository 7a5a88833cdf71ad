"""Packed attention: a query sees earlier tokens of its own segment and of its ancestors.

``packed_attention`` picks the implementation: the Triton kernel on CUDA when
Triton is installed and supports the head size, else the chunked SDPA path;
``VLLMEXT_KERNELS_FORCE_REF=1`` forces the fp32 reference.
"""

from __future__ import annotations

import importlib.util
import os
from functools import cache

import torch

from vllm_ext.kernels.packed_attention.ref import packed_attention_ref
from vllm_ext.kernels.packed_attention.sdpa import packed_attention_sdpa

__all__ = ["packed_attention", "packed_attention_ref", "packed_attention_sdpa"]


def packed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segment_of: torch.Tensor,
    visible: torch.Tensor,
    scale: float,
    key_start: torch.Tensor | None = None,
) -> torch.Tensor:
    """Segment-masked causal attention; see :func:`~.ref.packed_attention_ref`."""
    if os.environ.get("VLLMEXT_KERNELS_FORCE_REF") == "1":
        return packed_attention_ref(q, k, v, segment_of, visible, scale)
    if q.is_cuda and _has_triton():
        # imported here so that CPU callers never pay for importing Triton
        from vllm_ext.kernels.packed_attention import triton as tri

        # head sizes the kernel cannot tile (e.g. 80, 96) keep the SDPA path
        if tri.supports_head_dim(q.shape[2]):
            return tri.packed_attention_triton(q, k, v, segment_of, visible, scale, key_start)
    return packed_attention_sdpa(q, k, v, segment_of, visible, scale, key_start)


@cache
def _has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None
