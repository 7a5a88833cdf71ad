"""Triton for our GPU kernels, imported guardedly.

This module imports (and :data:`TRITON_AVAILABLE` is ``False``) on machines without
Triton, so every kernel module does too. Set ``TRITON_INTERPRET=1`` before the first
import of Triton to run the kernels on CPU tensors through Triton's interpreter (slow;
for tests).
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None
    tl = None

TRITON_AVAILABLE = triton is not None

__all__ = ["TRITON_AVAILABLE", "tl", "triton", "triton_usable"]


def triton_usable() -> bool:
    """True on a CUDA machine with Triton, unless ``VLLMEXT_KERNELS_FORCE_REF=1``."""
    forced = os.environ.get("VLLMEXT_KERNELS_FORCE_REF") == "1"
    return TRITON_AVAILABLE and not forced and torch.cuda.is_available()
