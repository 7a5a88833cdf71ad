"""The compiled row-sparse GEMM and the Triton one (in Triton's interpreter) equal the torch
reference and the dense masked product; the ETAPS linear method keeps its CPU paths."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vllm_ext.kernels.sparse_gemv import (
    compiled_available,
    kernel_available,
    sparse_gemm,
    sparse_gemm_ref,
)
from vllm_ext.kernels.sparse_gemv.ref import densify_ref

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[2]


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


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton not installed")
def test_triton_kernel_in_the_interpreter_equals_the_reference():
    """The GPU kernel on random and edge shapes through Triton's interpreter (a subprocess: the
    variable must be set before Triton is first imported); the same cases run on a GPU in
    ``tests/gpu/test_etaps_sparse_gemv_gpu.py``."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "tests.etaps_kernel_cases", "cpu", "float32", "bfloat16"]
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(line.split() for line in out.stdout.splitlines())
    assert set(lines) == {"triton/float32", "triton/bfloat16"}


def test_no_cuda_means_no_triton_path():
    # on CPU tensors the compiled kernel (or the reference) serves, never Triton
    assert kernel_available("cpu") == compiled_available()
    assert not kernel_available("meta")
    if not torch.cuda.is_available():
        assert not kernel_available("cuda")


@pytest.mark.parametrize("sparsity", [0.9, 0.5])
def test_linear_method_on_cpu_equals_the_reference(sparsity):
    """Decode calls on the compiled kernel (90 %), dense per call above the token limit, and
    densified at load below ``min_kernel_sparsity`` (50 %): all equal densify + matmul."""
    pytest.importorskip("vllm")
    from tests.etaps_kernel_cases import check_linear_method

    used_kernel = check_linear_method("cpu", sparsity)
    assert used_kernel == (sparsity >= 0.7 and compiled_available())
