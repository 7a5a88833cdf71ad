"""On a GPU: the Triton packed-attention kernel and the SDPA paths equal the reference.

fp32 within 2e-5 and bf16 within 2e-2 of the fp32 reference computed on CPU
(cases in ``tests/kernel_cases.py``).
"""

from __future__ import annotations

import pytest
import torch


def test_every_path_equals_the_reference_on_cuda():
    from tests.kernel_cases import check
    from vllm_ext.kernels.packed_attention import triton as tri

    if not tri.TRITON_AVAILABLE:
        pytest.skip("Triton not installed")
    worst = check("cuda", (torch.float32, torch.bfloat16))
    assert {"triton/float32", "triton/bfloat16"} <= set(worst)
