"""Pure-torch reference of the TVQ lookup matmul (fp32 accumulation, runs anywhere).

``y[t, r] = scale[r] * sum_g <x[t, gD:(g+1)D], codebook[shard(r), codes[r, g]]>``.
"""

from __future__ import annotations

import torch


def dequantize_shards(codes: torch.Tensor, codebook: torch.Tensor, scale: torch.Tensor,
                      shard_rows: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """Dense fp32 weight ``[rows, G*D]``.

    codes: [rows, G] (uint8/int32); codebook: [S, K, D]; scale: [rows, 1];
    shard_rows: [S + 1] int64 row offsets (rows ``shard_rows[s]:shard_rows[s+1]`` use codebook s).
    """
    rows, groups = codes.shape
    dim = codebook.shape[2]
    cb = codebook.float()
    w = torch.empty(rows, groups * dim, dtype=torch.float32, device=codes.device)
    for s in range(cb.shape[0]):
        lo, hi = int(shard_rows[s]), int(shard_rows[s + 1])
        w[lo:hi] = cb[s][codes[lo:hi].long()].reshape(hi - lo, groups * dim)
    return w * scale.float()


def tvq_matmul_ref(x: torch.Tensor, codes: torch.Tensor, codebook: torch.Tensor,
                   scale: torch.Tensor, shard_rows: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """x: [T, G*D] → [T, rows] in ``x.dtype`` (fp32 math)."""
    w = dequantize_shards(codes, codebook, scale, shard_rows)
    return (x.float() @ w.T).to(x.dtype)
