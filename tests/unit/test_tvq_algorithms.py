"""TVQ primitives: lookup, k-means, STE gradients, re-lookup switching, bit accounting, kernel."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from vllm_ext.kernels.tvq_gemv import kernel_available, tvq_gemv, tvq_matmul_ref
from vllm_ext.tvq.codebook import bits_per_weight, dequantize, kmeans, nearest
from vllm_ext.tvq.qat import VQLinear

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("seed", range(4))
def test_nearest_matches_brute_force(seed):
    g = torch.Generator().manual_seed(seed)
    dim = int(torch.randint(1, 9, (1,), generator=g))
    groups, cb = torch.randn(300, dim, generator=g), torch.randn(37, dim, generator=g)
    brute = torch.cdist(groups, cb).argmin(1)
    assert torch.equal(nearest(groups, cb, chunk=64), brute)


def test_kmeans_lowers_error_and_uses_every_codeword():
    g = torch.randn(4000, 4, generator=torch.Generator().manual_seed(0))
    err = []
    for iters in (0, 6):
        cb = kmeans(g, 64, iters=iters)
        err.append((g - cb[nearest(g, cb)]).pow(2).mean().item())
        assert cb.shape == (64, 4)
    assert err[1] < 0.8 * err[0]
    assert len(nearest(g, kmeans(g, 64, iters=6)).unique()) == 64


def test_bits_count_codebooks_and_scales():
    # SmolLM2 MLP linear, d=4, K=256: 2 bits of codes plus codebook and scale overhead
    bits = bits_per_weight(1536, 576, 4, 256)
    assert bits == pytest.approx(2 + 256 * 4 * 16 / (1536 * 576) + 16 / 576)


def _vq(rows=24, cols=16, dim=4, k=8, seed=0):
    torch.manual_seed(seed)
    return VQLinear(nn.Linear(cols, rows, bias=False), dim, k, kmeans_iters=4, seed=seed)


def test_forward_uses_codewords_and_backward_goes_straight_through():
    vq = _vq()
    x = torch.randn(5, 16)
    y = vq(x)
    assert torch.allclose(y, x @ dequantize(vq.codes, vq.codebook, vq.scale).T, atol=1e-6)
    y.sum().backward()
    # STE: the latent's gradient is exactly the dense linear's weight gradient
    expected = torch.ones(5, 24).T @ x
    assert torch.allclose(vq.weight.grad, expected, atol=1e-5)
    assert vq.codebook.grad is not None and vq.codebook.grad.abs().sum() > 0
    assert vq.scale.grad is not None


def test_relookup_switches_a_group_once_its_latent_moves():
    vq = _vq()
    code = int(vq.codes[3, 1])
    other = (code + 1) % vq.codebook.shape[0]
    with torch.no_grad():
        # halfway is not enough unless it is nearer: move all the way to another codeword
        vq.weight[3, 4:8] = vq.codebook[other] * vq.scale[3]
    assert vq.relookup() >= 1
    assert int(vq.codes[3, 1]) == other
    assert vq.relookup() == 0


@pytest.mark.skipif(not kernel_available(), reason="no C++ compiler for the TVQ kernel")
@pytest.mark.parametrize("seed", range(6))
def test_kernel_equals_reference_on_random_shapes(seed):
    g = torch.Generator().manual_seed(seed)
    r = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=g))  # noqa: E731
    dim, k, shards, tokens = r(1, 9), r(2, 257), r(1, 4), r(1, 6)
    groups = r(1, 40)
    sizes = [r(1, 50) for _ in range(shards)]
    rows = sum(sizes)
    bounds = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()])
    dtype = torch.uint8 if seed % 2 else torch.int32
    codes = torch.randint(0, k, (rows, groups), generator=g).to(dtype)
    cb = torch.randn(shards, k, dim, generator=g)
    scale = torch.rand(rows, 1, generator=g) + 0.1
    for xdtype in (torch.float32, torch.bfloat16):
        x = torch.randn(tokens, groups * dim, generator=g).to(xdtype)
        got = tvq_gemv(x, codes, cb, scale, bounds)
        ref = tvq_matmul_ref(x, codes, cb, scale, bounds)
        assert got.dtype == xdtype
        tol = 1e-4 if xdtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol * 10)


@pytest.mark.skipif(not kernel_available(), reason="no C++ compiler for the TVQ kernel")
def test_kernel_rejects_bad_shapes():
    codes = torch.zeros(4, 3, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="columns"):
        tvq_gemv(torch.randn(1, 11), codes, torch.randn(1, 8, 4), torch.ones(4, 1),
                 torch.tensor([0, 4]))  # fmt: skip


@pytest.mark.skipif(not kernel_available(), reason="no C++ compiler for the TVQ kernel")
def test_kernel_opcheck():
    codes = torch.randint(0, 16, (6, 3), dtype=torch.uint8)
    args = (
        torch.randn(2, 12),
        codes,
        torch.randn(2, 16, 4),
        torch.rand(6, 1),
        torch.tensor([0, 2, 6]),
    )
    torch.library.opcheck(torch.ops.vllm_ext_tvq.tvq_gemv.default, args,
                          test_utils=["test_schema", "test_faketensor"])  # fmt: skip


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton not installed")
def test_triton_kernel_in_the_interpreter_equals_the_reference():
    """The GPU kernel on random shapes through Triton's interpreter (a subprocess: the variable
    must be set before Triton is first imported); the same cases run on a GPU in ``tests/gpu``."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-m", "tests.tvq_kernel_cases", "cpu"], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert {line.split()[0] for line in out.stdout.splitlines()} == {"triton/float32"}
