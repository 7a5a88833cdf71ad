"""Saliency scores and per-row pruning masks (pure torch)."""

from __future__ import annotations

import torch

from vllm_ext.etaps.schedule import pruned_per_row


def etaps_score(weight: torch.Tensor, delta: torch.Tensor, grad_sum: torch.Tensor) -> torch.Tensor:
    """ETAPS score ``|w + Δ| · Σ|g|``: the patched weight times its accumulated gradient.

    Args:
        weight: ``[out, in]`` masked base weight.
        delta: ``[out, in]`` dense view of the slot increments (zero off the slots).
        grad_sum: ``[out, in]`` accumulated ``|dL/dw|`` over calibration and training.
    """
    return (weight.float() + delta.float()).abs() * grad_sum.float()


def magnitude_score(weight: torch.Tensor) -> torch.Tensor:
    """Magnitude pruning: ``|w|``."""
    return weight.float().abs()


def wanda_score(weight: torch.Tensor, input_sq_sum: torch.Tensor) -> torch.Tensor:
    """Wanda (Sun et al. 2023): ``|w_ij| · ‖x_j‖₂`` with ``input_sq_sum[j] = Σ x_j²``."""
    return weight.float().abs() * input_sq_sum.float().sqrt().unsqueeze(0)


def row_mask(
    score: torch.Tensor, sparsity: float, keep: torch.Tensor | None = None
) -> torch.Tensor:
    """Boolean keep-mask with the lowest ``sparsity`` of each row pruned.

    ``keep`` (the previous stage's mask) makes pruning monotone: weights pruned
    before stay pruned, whatever their score now.
    """
    n_prune = pruned_per_row(score.shape[1], sparsity)
    score = score.float()
    if keep is not None:
        score = score.masked_fill(~keep, float("-inf"))
    mask = torch.ones_like(score, dtype=torch.bool)
    if n_prune:
        lowest = torch.topk(score, n_prune, dim=1, largest=False).indices
        mask.scatter_(1, lowest, False)
    return mask
