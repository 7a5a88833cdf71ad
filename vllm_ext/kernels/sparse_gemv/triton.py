"""Row-sparse GEMV for GPUs as one Triton kernel (ETAPS decode: few tokens, many rows).

One program per (row tile, token tile): it walks the row tile's kept weights
``BLOCK_K`` at a time, loads their bf16 values and int16 columns once, gathers
``x`` at those columns for every token of the tile and accumulates in fp32. The
weight is read compact (4 bytes per kept weight, never densified), which is
what a memory-bound decode GEMV pays for; ``x`` (one row per token) stays in
L1/L2 across the gathers.

Triton comes from :mod:`vllm_ext.kernels.triton_support` (guarded import; ``TRITON_INTERPRET=1``
runs the kernel on CPU through Triton's interpreter, for tests).
"""

from __future__ import annotations

import torch

from vllm_ext.kernels.triton_support import TRITON_AVAILABLE, tl, triton, triton_usable

__all__ = ["TRITON_AVAILABLE", "sparse_gemm_triton", "triton_usable"]

BLOCK_ROWS = 16
BLOCK_NNZ = 64
# tokens per program: a decode batch of up to 16 re-reads each weight tile at most
# 4 times (from L2); the [tokens, rows, nnz] gather tile stays at 4K elements
MAX_BLOCK_TOKENS = 4


if TRITON_AVAILABLE:

    @triton.jit
    def _sparse_gemv_kernel(x_ptr, val_ptr, idx_ptr, y_ptr, tokens, rows, nnz, in_features,
                            BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                            BLOCK_K: tl.constexpr):  # fmt: skip
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        t = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = r < rows
        tok_ok = t < tokens
        w_row = r.to(tl.int64) * nnz
        x_row = t.to(tl.int64) * in_features
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k0 in range(0, nnz, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            ok = row_ok[:, None] & (k < nnz)[None, :]
            w = tl.load(val_ptr + w_row[:, None] + k[None, :], mask=ok, other=0.0)
            # the columns are unsigned 16-bit like the CPU kernel reads them (the
            # format keeps them below 32768, so this is also the signed value)
            col = tl.load(idx_ptr + w_row[:, None] + k[None, :], mask=ok, other=0)
            col = col.to(tl.int32) & 0xFFFF
            x_ok = tok_ok[:, None, None] & ok[None, :, :]
            xv = tl.load(x_ptr + x_row[:, None, None] + col[None, :, :], mask=x_ok, other=0.0)
            acc += tl.sum(xv.to(tl.float32) * w.to(tl.float32)[None, :, :], axis=2)
        out = y_ptr + t[:, None].to(tl.int64) * rows + r[None, :]
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=tok_ok[:, None] & row_ok[None, :])


def _check(x: torch.Tensor, values: torch.Tensor, indices: torch.Tensor) -> None:
    if x.dim() != 2 or values.dim() != 2 or indices.shape != values.shape:
        raise ValueError(f"sparse_gemm_triton: x {tuple(x.shape)}, values "
                         f"{tuple(values.shape)}, indices {tuple(indices.shape)}")  # fmt: skip
    if indices.dtype != torch.int16:
        raise ValueError(f"sparse_gemm_triton: indices must be int16, got {indices.dtype}")
    if not (x.device == values.device == indices.device):
        raise ValueError("sparse_gemm_triton: x, values and indices must share a device")


def sparse_gemm_triton(x: torch.Tensor, values: torch.Tensor,
                       indices: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """Same shapes and math as ``ref.sparse_gemm_ref``: ``[M, K] × row-sparse [N, K] → [M, N]``.

    No host sync: shapes come from tensor metadata, the columns are not range-checked
    (the exporter bounds them by ``in_features``).
    """
    if not TRITON_AVAILABLE:
        raise RuntimeError("sparse_gemm_triton needs Triton")
    _check(x, values, indices)
    tokens, in_features = x.shape
    rows, nnz = values.shape
    x = x.contiguous()
    y = torch.empty(tokens, rows, dtype=x.dtype, device=x.device)
    if tokens == 0 or rows == 0:
        return y
    block_m = min(triton.next_power_of_2(tokens), MAX_BLOCK_TOKENS)
    grid = (triton.cdiv(rows, BLOCK_ROWS), triton.cdiv(tokens, block_m))
    _sparse_gemv_kernel[grid](x, values.contiguous(), indices.contiguous(), y, tokens, rows,
                              nnz, in_features, BLOCK_M=block_m, BLOCK_R=BLOCK_ROWS,
                              BLOCK_K=BLOCK_NNZ)  # fmt: skip
    return y
