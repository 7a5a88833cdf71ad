"""Straight-through VQ linear: continuous latents behind the quantized forward.

The forward computes with each group's nearest codeword (times its row scale);
the backward sends the gradient straight through to the latent weight
(``w_q + latent - latent.detach()``), while the codebook and the scales get
their own gradients through the gather. :meth:`VQLinear.relookup` redoes the
lookup, so a group switches codeword once its latent has moved far enough.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vllm_ext.tvq.codebook import dequantize, kmeans, nearest, row_scales, to_groups


def code_dtype(num_codewords: int) -> torch.dtype:
    """uint8 codes up to 256 codewords, int32 above (vLLM stores what the checkpoint has)."""
    return torch.uint8 if num_codewords <= 256 else torch.int32


class VQLinear(nn.Module):
    """``nn.Linear`` with latent ``weight``, ``codebook [K, D]`` and ``scale [rows, 1]``."""

    def __init__(
        self,
        linear: nn.Linear,
        vec_dim: int,
        num_codewords: int,
        importance: torch.Tensor | None = None,
        kmeans_iters: int = 8,
        seed: int = 0,
    ):
        super().__init__()
        w = linear.weight.detach().float()
        self.vec_dim = vec_dim
        self.weight = nn.Parameter(w.clone())
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().float())
        self.scale = nn.Parameter(row_scales(w))
        groups = to_groups(w / self.scale.detach(), vec_dim)
        weights = None
        if importance is not None:
            # importance [cols]: a group's weight is its input columns' activation energy
            weights = importance.float().reshape(-1, vec_dim).sum(1).repeat(w.shape[0])
        self.codebook = nn.Parameter(kmeans(groups, num_codewords, kmeans_iters, weights, seed))
        self.register_buffer("codes", torch.zeros(w.shape[0], w.shape[1] // vec_dim,
                                                  dtype=code_dtype(num_codewords)))  # fmt: skip
        self.relookup()

    @torch.no_grad()
    def relookup(self) -> int:
        """Recompute every code from the latents; returns how many groups changed codeword."""
        groups = to_groups(self.weight / self.scale, self.vec_dim)
        new = nearest(groups, self.codebook).reshape(self.codes.shape).to(self.codes.dtype)
        changed = int((new != self.codes).sum())
        self.codes.copy_(new)
        return changed

    def quantized_weight(self) -> torch.Tensor:
        return dequantize(self.codes, self.codebook, self.scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.quantized_weight() + (self.weight - self.weight.detach())
        return F.linear(x, w.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))


MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")


def quantize_mlps(model: nn.Module, vec_dim: int, num_codewords: int, kmeans_iters: int = 8,
                  importance: dict[str, torch.Tensor] | None = None,
                  progress=None) -> dict[str, VQLinear]:  # fmt: skip
    """Replace every decoder layer's MLP linears by :class:`VQLinear` (k-means init).

    ``importance`` maps a module name to its input columns' calibration
    activation energy; ``progress`` is an optional tqdm-like ``update()``.
    """
    out: dict[str, VQLinear] = {}
    for name, module in list(model.named_modules()):
        for attr in MLP_LINEARS:
            child = getattr(module, attr, None)
            if isinstance(child, nn.Linear):
                full = f"{name}.{attr}"
                imp = None if importance is None else importance.get(full)
                vq = VQLinear(child, vec_dim, num_codewords, imp, kmeans_iters)
                module.register_module(attr, vq)  # replaces the nn.Linear child
                out[full] = vq
                if progress is not None:
                    progress.update(1)
    return out
