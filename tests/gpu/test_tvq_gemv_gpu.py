"""On a GPU: the TVQ Triton lookup-GEMV equals the fp32 reference computed on CPU.

fp32 within 1e-4, bf16 within 2e-2, fp16 within 5e-3 (relative; cases in
``tests/tvq_kernel_cases.py``).
"""

from __future__ import annotations

import pytest


def test_triton_gemv_equals_the_reference_on_cuda():
    import torch

    from tests.tvq_kernel_cases import check
    from vllm_ext.kernels.tvq_gemv import triton as tri

    if not tri.TRITON_AVAILABLE:
        pytest.skip("Triton not installed")
    worst = check("cuda", (torch.float32, torch.bfloat16, torch.float16))
    assert set(worst) == {"triton/float32", "triton/bfloat16", "triton/float16"}
