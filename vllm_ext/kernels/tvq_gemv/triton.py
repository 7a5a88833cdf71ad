"""TVQ lookup-GEMV for GPUs as one Triton kernel (decode: few tokens, many rows).

One program per (token, row tile): it walks the row tile's codes group tile by
group tile, gathers each code's codeword from the row's shard codebook (small,
stays in L1/L2) and accumulates ``<x_group, codeword>`` in fp32, so the weight
is read as codes (``log2 K / D`` bits per weight) and never materialised.

Triton comes from :mod:`vllm_ext.kernels.triton_support` (guarded import; ``TRITON_INTERPRET=1``
runs the kernel on CPU through Triton's interpreter, for tests).
"""

from __future__ import annotations

import torch

from vllm_ext.kernels.triton_support import TRITON_AVAILABLE, tl, triton, triton_usable

__all__ = ["TRITON_AVAILABLE", "row_shards", "triton_usable", "tvq_gemv_triton"]

BLOCK_ROWS = 32
BLOCK_GROUPS = 32


def row_shards(shard_rows: torch.Tensor, rows: int) -> torch.Tensor:
    """int32 ``[rows]``: the codebook index of each output row (once per layer, not per call)."""
    ids = torch.arange(rows, device=shard_rows.device)
    return torch.searchsorted(shard_rows[1:].to(ids.device), ids, right=True).to(torch.int32)


if TRITON_AVAILABLE:

    @triton.jit
    def _tvq_gemv_kernel(x_ptr, codes_ptr, cb_ptr, scale_ptr, shard_ptr, y_ptr, rows, groups,
                         num_codewords, DIM: tl.constexpr, BLOCK_R: tl.constexpr,
                         BLOCK_G: tl.constexpr):  # fmt: skip
        t = tl.program_id(0)
        r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok = r < rows
        shard = tl.load(shard_ptr + r, mask=row_ok, other=0).to(tl.int64)
        cb_row = cb_ptr + shard * num_codewords * DIM
        acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for g0 in range(0, groups, BLOCK_G):
            g = g0 + tl.arange(0, BLOCK_G)
            g_ok = g < groups
            ok = row_ok[:, None] & g_ok[None, :]
            code = tl.load(codes_ptr + r[:, None].to(tl.int64) * groups + g[None, :], mask=ok,
                           other=0).to(tl.int64)  # fmt: skip
            for d in tl.static_range(DIM):
                w = tl.load(cb_row[:, None] + code * DIM + d, mask=ok, other=0.0)
                xv = tl.load(x_ptr + t * groups * DIM + g * DIM + d, mask=g_ok, other=0.0)
                acc += tl.sum(w * xv.to(tl.float32)[None, :], axis=1)
        s = tl.load(scale_ptr + r, mask=row_ok, other=0.0)
        tl.store(y_ptr + t * rows + r, (acc * s).to(y_ptr.dtype.element_ty), mask=row_ok)


def tvq_gemv_triton(x: torch.Tensor, codes: torch.Tensor, codebook: torch.Tensor,
                    scale: torch.Tensor, shard_rows: torch.Tensor,
                    shards: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """Same shapes and math as ``ref.tvq_matmul_ref``; ``shards`` from :func:`row_shards`."""
    if not TRITON_AVAILABLE:
        raise RuntimeError("tvq_gemv_triton needs Triton")
    rows, groups = codes.shape
    num_shards, num_codewords, dim = codebook.shape
    if x.dim() != 2 or x.shape[1] != groups * dim:
        raise ValueError(f"tvq_gemv_triton: x {tuple(x.shape)} does not match codes "
                         f"{tuple(codes.shape)} with vec_dim {dim}")  # fmt: skip
    if shards is None:
        shards = row_shards(shard_rows, rows)
    x = x.contiguous()
    y = torch.empty(x.shape[0], rows, dtype=x.dtype, device=x.device)
    grid = (x.shape[0], triton.cdiv(rows, BLOCK_ROWS))
    _tvq_gemv_kernel[grid](x, codes.contiguous(), codebook.float().contiguous(),
                           scale.float().reshape(-1).contiguous(), shards, y, rows, groups,
                           num_codewords, DIM=dim, BLOCK_R=BLOCK_ROWS,
                           BLOCK_G=BLOCK_GROUPS)  # fmt: skip
    return y
