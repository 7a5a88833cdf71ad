"""The compiled row-sparse GEMM equals the torch reference and the dense masked product."""

from __future__ import annotations

import pytest
import torch

from vllm_ext.kernels.sparse_gemv import compiled_available, sparse_gemm, sparse_gemm_ref
from vllm_ext.kernels.sparse_gemv.ref import densify_ref

pytestmark = pytest.mark.unit


def _case(seed: int):
    gen = torch.Generator().manual_seed(seed)
    m = int(torch.randint(1, 6, (1,), generator=gen))
    n, k = (int(v) for v in torch.randint(1, 300, (2,), generator=gen))
    sparsity = float(torch.rand(1, generator=gen)) * 0.95
    nnz = max(1, k - int(k * sparsity))
    idx = torch.stack([torch.randperm(k, generator=gen)[:nnz] for _ in range(n)]).short()
    values = torch.randn(n, nnz, generator=gen).bfloat16()
    x = torch.randn(m, k, generator=gen).bfloat16()
    return x, values, idx, k


@pytest.mark.parametrize("seed", range(8))
def test_ref_equals_dense_masked_product(seed):
    x, values, idx, k = _case(seed)
    dense = densify_ref(values, idx, k).float()
    expected = (x.float() @ dense.T).bfloat16()
    assert torch.allclose(
        sparse_gemm_ref(x, values, idx).float(), expected.float(), rtol=1e-2, atol=1e-2
    )


@pytest.mark.parametrize("seed", range(8))
def test_compiled_equals_ref(seed):
    if not compiled_available():
        pytest.skip("no C++ toolchain: the compiled kernel cannot build here")
    x, values, idx, _ = _case(seed)
    got = sparse_gemm(x, values, idx).float()
    ref = sparse_gemm_ref(x, values, idx).float()
    # both accumulate in fp32; only the summation order and the bf16 rounding differ
    assert torch.allclose(got, ref, rtol=1e-2, atol=1e-2)


def test_compiled_rejects_bad_input():
    if not compiled_available():
        pytest.skip("no C++ toolchain")
    from vllm_ext.kernels.sparse_gemv import ops

    x, values, idx, _ = _case(0)
    with pytest.raises(RuntimeError, match="int16"):
        ops.sparse_gemm(x, values, idx.int())
