"""On a GPU: the ETAPS Triton row-sparse GEMV equals the fp32 densify + matmul reference.

fp32 within 1e-4, bf16 within 2e-2, fp16 within 5e-3 (relative; cases in
``tests/etaps_kernel_cases.py``, which also run on CPU through Triton's interpreter), and
the ``etaps`` linear method serves decode-size calls with it.
"""

from __future__ import annotations

import pytest


def _triton():
    from vllm_ext.kernels.sparse_gemv import triton as tri

    if not tri.TRITON_AVAILABLE:
        pytest.skip("Triton not installed")
    return tri


def test_triton_sparse_gemv_equals_the_reference_on_cuda():
    import torch

    from tests.etaps_kernel_cases import check

    _triton()
    worst = check("cuda", (torch.float32, torch.bfloat16, torch.float16))
    assert set(worst) == {"triton/float32", "triton/bfloat16", "triton/float16"}


def test_linear_method_takes_the_triton_kernel_on_cuda():
    pytest.importorskip("vllm")
    from tests.etaps_kernel_cases import check_linear_method

    _triton()
    assert check_linear_method("cuda", 0.9)
    assert not check_linear_method("cuda", 0.5)
