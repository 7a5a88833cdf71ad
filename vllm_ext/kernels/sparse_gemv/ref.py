"""Reference row-sparse GEMM (pure torch, fp32 accumulation, CPU).

``y[m, r] = Σ_k values[r, k] · x[m, indices[r, k]]``.

Args: ``x: [M, K]`` (bf16/fp32), ``values: [N, nnz]`` bf16, ``indices: [N, nnz]`` int16
(column of each kept weight; every row keeps the same ``nnz``). Returns ``[M, N]`` in ``x``'s dtype.
"""

from __future__ import annotations

import torch


def sparse_gemm_ref(x: torch.Tensor, values: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    gathered = x.float()[:, indices.long()]  # [M, N, nnz]
    return (gathered * values.float().unsqueeze(0)).sum(-1).to(x.dtype)


def densify_ref(values: torch.Tensor, indices: torch.Tensor, in_features: int) -> torch.Tensor:
    """The dense ``[N, in_features]`` weight the compact form stands for."""
    dense = torch.zeros(values.shape[0], in_features, dtype=values.dtype, device=values.device)
    return dense.scatter_(1, indices.long(), values)
