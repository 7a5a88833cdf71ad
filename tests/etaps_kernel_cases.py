"""Random cases for the ETAPS Triton row-sparse GEMV against the fp32 densify + matmul reference.

``python -m tests.etaps_kernel_cases DEVICE [DTYPE ...]`` prints one ``triton/<dtype> <worst
error>`` line per dtype and exits non-zero on the first mismatch. On CPU run it with
``TRITON_INTERPRET=1`` (set before Triton is first imported); there the shapes stay tiny.
"""

from __future__ import annotations

import sys

import torch

from vllm_ext.etaps.sparse_format import MAX_IN_FEATURES
from vllm_ext.kernels.sparse_gemv.ref import densify_ref
from vllm_ext.kernels.sparse_gemv.triton import BLOCK_NNZ, BLOCK_ROWS, sparse_gemm_triton

# relative to |reference| + 1; bf16/fp16 outputs are rounded once (2^-8, 2^-11)
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}
DTYPES = {str(d).removeprefix("torch."): d for d in TOLERANCE}
# (tokens, rows, in_features, nnz) off and on the tile multiples: one partial tile each way,
# several nnz chunks with a partial last one, a single kept weight, exact multiples, and the
# widest input int16 columns address (MAX_IN_FEATURES)
EDGES = [
    (1, 1, 1, 1),
    (3, BLOCK_ROWS + 5, 3 * BLOCK_NNZ, 2 * BLOCK_NNZ + 7),
    (16, 2 * BLOCK_ROWS, 2 * BLOCK_NNZ, BLOCK_NNZ),
    (5, 7, 300, 1),
    (2, 3, MAX_IN_FEATURES, 100),
]


def _random_shape(gen: torch.Generator, big: bool) -> tuple[int, int, int, int]:
    """Decode batch sizes 1..16, sparsities 0..97 %; ``big`` widens rows and columns (GPU)."""
    scale = 8 if big else 1
    tokens = int(torch.randint(1, 17, (1,), generator=gen))
    rows = int(torch.randint(1, 3 * BLOCK_ROWS * scale, (1,), generator=gen))
    in_features = int(torch.randint(1, 3 * BLOCK_NNZ * scale, (1,), generator=gen))
    sparsity = float(torch.rand(1, generator=gen)) * 0.97
    return tokens, rows, in_features, max(1, in_features - int(in_features * sparsity))


def make_case(gen: torch.Generator, shape, device: str, dtype: torch.dtype):
    """``x [tokens, in]`` in ``dtype``, bf16 ``values`` and int16 ``indices`` (each row's own
    random columns, in random order: the kernel must not rely on the exporter's sorting)."""
    tokens, rows, in_features, nnz = shape
    idx = torch.stack([torch.randperm(in_features, generator=gen)[:nnz] for _ in range(rows)])
    values = torch.randn(rows, nnz, generator=gen).bfloat16()
    x = torch.randn(tokens, in_features, generator=gen).to(dtype)
    return x.to(device), values.to(device), idx.short().to(device)


def reference(x: torch.Tensor, values: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """fp32 on CPU: the dense weight the compact form stands for, times ``x``."""
    dense = densify_ref(values.cpu(), indices.cpu(), x.shape[1]).float()
    return x.cpu().float() @ dense.T


def check(device: str, dtypes=(torch.float32,), cases: int = 10) -> dict[str, float]:
    gen = torch.Generator().manual_seed(0)
    worst: dict[str, float] = {}
    for dtype in dtypes:
        key = f"triton/{str(dtype).removeprefix('torch.')}"
        shapes = EDGES + [_random_shape(gen, device != "cpu") for _ in range(cases)]
        for shape in shapes:
            x, values, indices = make_case(gen, shape, device, dtype)
            got = sparse_gemm_triton(x, values, indices)
            if got.dtype != dtype or got.shape != (shape[0], shape[1]):
                raise AssertionError(f"{key}: got {got.dtype} {tuple(got.shape)} on {shape}")
            want = reference(x, values, indices)
            err = float(((got.float().cpu() - want).abs() / (want.abs() + 1)).max())
            if not err <= TOLERANCE[dtype]:
                raise AssertionError(f"{key}: error {err} on (tokens, rows, in, nnz) {shape}")
            worst[key] = max(worst.get(key, 0.0), err)
    return worst


def check_linear_method(device: str, sparsity: float = 0.9, tokens=(1, 5, 8, 9, 40)) -> bool:
    """``EtapsSparseLinearMethod`` on ``device`` (vLLM imported here, not for the kernel cases):
    decode- and prefill-size calls, with bias, equal the reference; returns ``layer.use_kernel``
    (which kernel served decode is up to :func:`sparse_gemm`'s dispatch on the device)."""
    from vllm_ext.etaps.config import EtapsConfig
    from vllm_ext.etaps.linear_method import EtapsQuantizationConfig, EtapsSparseLinearMethod
    from vllm_ext.etaps.sparse_format import SparseFormat

    gen = torch.Generator().manual_seed(1)
    fmt, rows, in_features = SparseFormat(sparsity), 3 * BLOCK_ROWS + 3, 2 * BLOCK_NNZ + 9
    method = EtapsSparseLinearMethod(EtapsQuantizationConfig(fmt, EtapsConfig()))
    layer = torch.nn.Module()
    method.create_weights(layer, in_features, [rows], in_features, rows, torch.float32)
    shape = (1, rows, in_features, fmt.nnz(in_features))
    _, values, indices = make_case(gen, shape, "cpu", torch.float32)
    layer.values.data.copy_(values)
    layer.indices.data.copy_(indices)
    layer.to(device)
    method.process_weights_after_loading(layer)
    bias = torch.randn(rows, generator=gen)
    for n in tokens:
        x = torch.randn(n, in_features, generator=gen)
        got = method.apply(layer, x.to(device), bias.to(device)).cpu()
        want = reference(x, values, indices) + bias
        err = float(((got - want).abs() / (want.abs() + 1)).max())
        if not err <= TOLERANCE[torch.float32]:
            raise AssertionError(f"linear method on {device}, {n} tokens: error {err}")
    return bool(layer.use_kernel)


if __name__ == "__main__":
    dev = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    types = [DTYPES[name] for name in sys.argv[2:]] or [torch.float32, torch.bfloat16]
    for name, error in check(dev, types).items():
        print(name, f"{error:.3g}")
