"""Packed attention: a query sees earlier tokens of its own segment and of its ancestors.

``packed_attention`` picks the implementation: the Triton kernel on CUDA when
available, else the chunked SDPA path; ``VLLM_EXT_KERNELS_FORCE_REF=1`` forces
the fp32 reference.
"""

from __future__ import annotations

import os

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
    if os.environ.get("VLLM_EXT_KERNELS_FORCE_REF") == "1":
        return packed_attention_ref(q, k, v, segment_of, visible, scale)
    return packed_attention_sdpa(q, k, v, segment_of, visible, scale, key_start)
