"""Vector-quantization primitives: groups, k-means codebooks, nearest-codeword lookup.

A weight ``W [rows, cols]`` is split into row-wise groups of ``D`` consecutive
weights; ``scale [rows, 1]`` normalises each row first, so one codebook
``[K, D]`` fits every row. ``codes [rows, cols/D]`` index the codebook.
"""

from __future__ import annotations

import torch


def row_scales(weight: torch.Tensor) -> torch.Tensor:
    """Per-row RMS of ``weight [rows, cols]`` as ``[rows, 1]`` (never zero)."""
    return weight.float().pow(2).mean(dim=1, keepdim=True).sqrt().clamp_min(1e-8)


def to_groups(weight: torch.Tensor, vec_dim: int) -> torch.Tensor:
    """``[rows, cols]`` → ``[rows * cols/D, D]``."""
    rows, cols = weight.shape
    if cols % vec_dim:
        raise ValueError(f"input size {cols} is not a multiple of vec_dim {vec_dim}")
    return weight.reshape(rows * (cols // vec_dim), vec_dim)


def nearest(groups: torch.Tensor, codebook: torch.Tensor, chunk: int = 65536) -> torch.Tensor:
    """Index of the nearest codeword (squared L2) for each row of ``groups [N, D]``."""
    cb = codebook.float()
    cb_sq = cb.pow(2).sum(1)
    out = torch.empty(groups.shape[0], dtype=torch.long, device=groups.device)
    for start in range(0, groups.shape[0], chunk):
        g = groups[start : start + chunk].float()
        # |g - c|^2 = |g|^2 - 2 g.c + |c|^2; |g|^2 does not change the argmin
        out[start : start + chunk] = (cb_sq - 2 * g @ cb.T).argmin(1)
    return out


def kmeans(
    groups: torch.Tensor,
    num_codewords: int,
    iters: int = 8,
    weights: torch.Tensor | None = None,
    seed: int = 0,
    sample: int | None = 32768,
) -> torch.Tensor:
    """Codebook ``[K, D]`` fitted to ``groups [N, D]`` by (importance-weighted) Lloyd k-means.

    ``weights [N]`` (e.g. calibration activation energy of each group's input
    columns) weighs the centroid update, as in GPTQ/AQLM-style Hessian-aware init.
    """
    g = groups.float()
    gen = torch.Generator().manual_seed(seed)
    if sample is not None and g.shape[0] > sample:
        # Lloyd steps on a random subset: the codebook of 221k groups barely changes, 7x cheaper
        pick = torch.randperm(g.shape[0], generator=gen)[:sample]
        g = g[pick]
        weights = None if weights is None else weights[pick]
    n = g.shape[0]
    if n >= num_codewords:
        init = torch.randperm(n, generator=gen)[:num_codewords]
        cb = g[init].clone()
    else:
        cb = torch.randn(num_codewords, g.shape[1], generator=gen) * g.std()
        cb[:n] = g
    w = torch.ones(n) if weights is None else weights.float().clamp_min(1e-12)
    for _ in range(iters):
        codes = nearest(g, cb)
        mass = torch.zeros(num_codewords).index_add_(0, codes, w)
        sums = torch.zeros_like(cb).index_add_(0, codes, g * w[:, None])
        filled = mass > 0
        cb[filled] = sums[filled] / mass[filled, None]
        # an empty codeword restarts at a random group, so no code is wasted
        empty = int((~filled).sum())
        if empty:
            cb[~filled] = g[torch.randint(n, (empty,), generator=gen)]
    return cb


def dequantize(codes: torch.Tensor, codebook: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``W = codebook[codes] * scale``: codes [rows, G], codebook [K, D], scale [rows, 1]."""
    rows, groups = codes.shape
    w = codebook[codes.long()].reshape(rows, groups * codebook.shape[1])
    return w * scale


def bits_per_weight(rows: int, cols: int, vec_dim: int, num_codewords: int,
                    codebook_bits: int = 16, scale_bits: int = 16) -> float:  # fmt: skip
    """Storage per weight with codebook and scales counted: log2(K)/D + overheads."""
    code_bits = (num_codewords - 1).bit_length()
    total = rows * (cols // vec_dim) * code_bits
    total += num_codewords * vec_dim * codebook_bits + rows * scale_bits
    return total / (rows * cols)
