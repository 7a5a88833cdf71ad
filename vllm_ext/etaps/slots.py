"""Fixed-slot weight increments: a constant number of trainable deltas per linear.

The slots sit on surviving weights; when a stage prunes a slot's weight, the
slot migrates to the surviving weight (not yet a slot) with the largest
accumulated gradient and its increment restarts at zero. The optimizer state
is therefore ``O(slots)``, not ``O(weights)`` as in ELSA's ADMM.
"""

from __future__ import annotations

import torch


def initial_slots(grad_sum: torch.Tensor, keep: torch.Tensor, count: int) -> torch.Tensor:
    """Flat indices of the ``count`` surviving weights with the largest accumulated gradient."""
    if count > int(keep.sum()):
        raise ValueError(f"{count} slots but only {int(keep.sum())} surviving weights")
    score = grad_sum.float().flatten().masked_fill(~keep.flatten(), float("-inf"))
    return torch.topk(score, count).indices.sort().values


def migrate_slots(
    slots: torch.Tensor, delta: torch.Tensor, grad_sum: torch.Tensor, keep: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Move the slots whose weight was pruned; keep the others and their increments.

    Args:
        slots: ``[S]`` flat indices into the ``[out, in]`` weight.
        delta: ``[S]`` increments of those slots.
        grad_sum: ``[out, in]`` accumulated ``|g|``.
        keep: ``[out, in]`` keep-mask after this stage's pruning.

    Returns:
        ``(slots, delta, moved)``: the same number of slots, all on kept weights,
        no duplicates; moved slots have increment 0 and ``moved`` marks them.
    """
    flat_keep = keep.flatten()
    dead = ~flat_keep[slots]
    n_dead = int(dead.sum())
    if n_dead == 0:
        return slots, delta, dead
    taken = torch.zeros_like(flat_keep)
    taken[slots[~dead]] = True
    candidates = grad_sum.float().flatten().masked_fill(~flat_keep | taken, float("-inf"))
    if n_dead > int(torch.isfinite(candidates).sum()):
        raise ValueError(f"{n_dead} slots to move but too few free surviving weights")
    targets = torch.topk(candidates, n_dead).indices
    slots = slots.clone()
    slots[dead] = targets
    delta = delta.clone()
    delta[dead] = 0.0
    return slots, delta, dead


def dense_delta(slots: torch.Tensor, delta: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """The increments as a dense ``shape`` tensor (differentiable in ``delta``)."""
    flat = torch.zeros(shape.numel(), dtype=delta.dtype, device=delta.device)
    return flat.index_add(0, slots, delta).view(shape)
