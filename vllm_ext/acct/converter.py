"""Converters: the source's hidden states -> keys and values of the target's later layers.

One linear map per converted target layer, from the RMS-normalised residual
stream after the source's last layer to that layer's pre-RoPE keys and its
values for every KV head; RoPE is then applied at the tokens' true positions,
so a converted key sits in the paged cache exactly where the target's own key
would. Normalising the features matters: the residual stream carries a few
massive activations that make an unnormalised fit collapse (acct.md §3).

:func:`ridge_fit` is the closed-form initialisation (least squares on the
target's own K/V); the end-to-end trainer (:mod:`vllm_ext.acct.train`) then
fits the same parameters to the target's output distribution.
"""

from __future__ import annotations

import torch
from torch import nn

from vllm_ext.acct.llama import KV, LlamaShape, Rope, rms_normalize


class Converters(nn.Module):
    """Linear converters for target layers ``first_layer .. num_layers - 1``."""

    def __init__(self, shape: LlamaShape, first_layer: int, feature_size: int | None = None):
        super().__init__()
        if not 0 <= first_layer <= shape.num_layers:
            raise ValueError(f"first_layer {first_layer} outside 0..{shape.num_layers}")
        self.shape = shape
        self.first_layer = first_layer
        self.feature_size = feature_size or shape.hidden_size
        self.eps = shape.rms_norm_eps
        self.proj = nn.ModuleList(
            nn.Linear(self.feature_size, 2 * shape.kv_width)
            for _ in range(first_layer, shape.num_layers)
        )
        for linear in self.proj:
            nn.init.zeros_(linear.weight)
            nn.init.zeros_(linear.bias)

    @property
    def layers(self) -> range:
        return range(self.first_layer, self.shape.num_layers)

    def features(self, hidden: torch.Tensor) -> torch.Tensor:
        return rms_normalize(
            hidden.to(self.proj[0].weight.dtype) if self.proj else hidden, self.eps
        )

    def convert(
        self, layer: int, features: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]
    ) -> KV:
        """Post-RoPE keys and values ``[kv_heads, tokens, head_dim]`` of target ``layer``."""
        s = self.shape
        out = self.proj[layer - self.first_layer](features)
        n = features.shape[0]
        k_pre = out[:, : s.kv_width].view(n, s.num_kv_heads, s.head_dim).transpose(0, 1)
        v = out[:, s.kv_width :].view(n, s.num_kv_heads, s.head_dim).transpose(0, 1)
        return Rope.apply(k_pre, *cos_sin), v


class RidgeAccumulator:
    """Normal equations of ``[features, 1] @ W = [pre-RoPE K, V]`` for every converted layer."""

    def __init__(self, converters: Converters):
        self.converters = converters
        d = converters.feature_size + 1
        self.xtx = torch.zeros(d, d, dtype=torch.float64)
        self.xty = [
            torch.zeros(d, 2 * converters.shape.kv_width, dtype=torch.float64)
            for _ in converters.layers
        ]
        self.rows = 0

    def add(self, features: torch.Tensor, targets: dict[int, tuple[torch.Tensor, torch.Tensor]]):
        """``targets[layer] = (pre-RoPE K, V)``, each ``[kv_heads, tokens, head_dim]``."""
        x = torch.cat([features, torch.ones(features.shape[0], 1, dtype=features.dtype)], 1)
        x = x.double()
        self.xtx += x.T @ x
        for i, layer in enumerate(self.converters.layers):
            k_pre, v = targets[layer]
            y = torch.cat([_token_major(k_pre), _token_major(v)], 1).double()
            self.xty[i] += x.T @ y
        self.rows += x.shape[0]

    def solve(self, alpha: float) -> None:
        """Write the ridge solution into the converters (``alpha`` relative to the mean diag)."""
        if self.rows == 0:
            raise ValueError("ridge fit without data")
        d = self.xtx.shape[0]
        reg = alpha * self.xtx.diagonal()[:-1].mean() * torch.eye(d, dtype=torch.float64)
        reg[-1, -1] = 0.0
        factor = torch.linalg.cholesky(self.xtx + reg)
        with torch.no_grad():
            for linear, xty in zip(self.converters.proj, self.xty, strict=True):
                w = torch.cholesky_solve(xty, factor)
                linear.weight.copy_(w[:-1].T.to(linear.weight.dtype))
                linear.bias.copy_(w[-1].to(linear.bias.dtype))


def _token_major(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(0, 1).reshape(x.shape[1], -1)
