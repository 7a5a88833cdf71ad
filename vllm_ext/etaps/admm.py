"""An ELSA-like ADMM pruning baseline (ELSA: extreme LLM sparsity via ADMM).

Minimises the language-modelling loss over the prunable weights ``W`` subject to
``W = Z`` with ``Z`` row-sparse (each row keeps its largest ``|.|``, pruning
``pruned_per_row(in, sparsity)`` like Wanda, SparseGPT and ETAPS here, so every
pruner lands on the same sparse format). Scaled-form ADMM, one calibration
block per iteration so the token budget is exactly the blocks given:

- W-step: ``steps`` Adam (or SGD) steps on ``loss(W) + ρ/2 Σ‖W − Z + U‖²`` — the
  penalty's gradient added to the loss's, or (``prox``) Adam on the loss then the
  penalty's exact proximal step, which small budgets need (see ``prune_admm``);
- Z-step: ``Z = Π(W + U)`` (per-row top-k by magnitude);
- U-step: ``U += W − Z``;
- ``ρ`` grows by ``rho_growth`` per iteration (ELSA raises it so W settles on Z);
  the scaled dual is rescaled by ``ρ_old/ρ_new`` to stay the same unscaled dual.

At the end ``W`` is hard-pruned to ``Z``'s mask: the model is exactly at the target
sparsity. Its memory is the point of comparison with ETAPS: besides the model it
holds ``Z``, ``U``, a gradient and two Adam moments for every prunable weight.
"""

from __future__ import annotations

import time

import torch

from vllm_ext.etaps.model_io import prunable_linears
from vllm_ext.etaps.pruner import lm_loss
from vllm_ext.etaps.schedule import pruned_per_row
from vllm_ext.etaps.scores import magnitude_score, row_mask

FP32 = 4
# settings for a budget of a few blocks, from a 4-block sweep on SmolLM2-135M at 70 %: with Adam
# on the penalty's gradient the pruned weights move ~lr per step, never reach Z in a few blocks,
# the dual grows and the mask oscillates (ppl 1e5-1e8); the exact prox step with rho doubling
# each block lands W on Z. The pruning CLI and benchmarks.etaps.quality use them.
FEW_BLOCKS = {"lr": 3e-4, "rho": 1.0, "rho_growth": 2.0, "prox": True}


def project_rows(weight: torch.Tensor, sparsity: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Z-step: ``(Z, keep)``, each row of ``weight`` with its smallest ``|.|`` zeroed.

    The same mask as :func:`row_mask` of ``|w|`` (up to ties); top-k runs over the
    kept side when it is the smaller one (a 2x faster Z-step at high sparsity).
    """
    score = magnitude_score(weight)
    n_keep = weight.shape[1] - pruned_per_row(weight.shape[1], sparsity)
    if 2 * n_keep > weight.shape[1]:
        keep = row_mask(score, sparsity)
    else:
        keep = torch.zeros_like(score, dtype=torch.bool)
        keep.scatter_(1, torch.topk(score, n_keep, dim=1).indices, True)
    return weight * keep.to(weight.dtype), keep


def extra_state_bytes(weights: list[torch.Tensor], optimizer: str) -> dict[str, int]:
    """Bytes ADMM holds beyond the model, by kind (fp32, one of each per prunable weight)."""
    n = sum(w.numel() for w in weights)
    parts = {"z": n * FP32, "u": n * FP32, "grad": n * FP32}
    parts["optimizer_moments"] = n * FP32 * (2 if optimizer == "adam" else 0)
    return parts


def _optimizer(params: list[torch.Tensor], name: str, lr: float) -> torch.optim.Optimizer:
    if name == "adam":  # fused: one pass per tensor, 7x faster than foreach on CPU
        return torch.optim.Adam(params, lr=lr, fused=True)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    raise ValueError(f"optimizer must be 'adam' or 'sgd', got {name!r}")


@torch.no_grad()
def _penalty_prox(weights, z, u, rho: float) -> None:
    """``W = argmin ½‖V − W_opt‖² + ρ/2‖V − Z + U‖²``: pull W by ``ρ/(1+ρ)`` towards ``Z − U``."""
    pull = rho / (1.0 + rho)
    for w, zi, ui in zip(weights, z, u, strict=True):
        w.mul_(1.0 - pull).add_(zi, alpha=pull).sub_(ui, alpha=pull)


@torch.no_grad()
def _add_penalty_grad(weights, z, u, rho: float) -> None:
    """``grad += ρ (W − Z + U)``, the penalty's gradient, in place (no autograd temporaries)."""
    for w, zi, ui in zip(weights, z, u, strict=True):
        w.grad.add_(w, alpha=rho).sub_(zi, alpha=rho).add_(ui, alpha=rho)


def prune_admm(
    model: torch.nn.Module,
    blocks: torch.Tensor,
    sparsity: float,
    *,
    steps: int = 1,
    rho: float = 1e-2,
    rho_growth: float = 1.0,
    lr: float = 2e-4,
    optimizer: str = "adam",
    prox: bool = False,
) -> dict:
    """ADMM-prune every prunable linear of ``model`` in place, one ADMM iteration per block.

    Args:
        blocks: ``[n, T]`` token blocks; iteration ``i`` trains on block ``i`` only.
        steps: optimizer steps per W-step (all on that iteration's block).
        rho: initial penalty weight; ``rho_growth`` multiplies it after every iteration.
        prox: the optimizer steps on the loss alone, each followed by the penalty's exact
            proximal step (unit step size) instead of adding its gradient: Adam moves every
            weight by about ``lr`` per step, so within a few blocks it cannot bring the pruned
            weights to Z and the dual grows until the mask oscillates; the prox step can.

    Returns:
        stats: ``blocks_used``, ``tokens``, per-iteration ``loss`` (LM loss of the
        last W-step) and ``gap`` (``Σ‖W − Z‖²`` after the Z-step), ``final_rho``,
        ``extra_state_bytes`` (total) with its ``extra_state`` breakdown, ``cpu_s``.
    """
    if blocks.ndim != 2 or blocks.shape[0] < 1:
        raise ValueError(f"blocks must be [n >= 1, T] token ids, got shape {tuple(blocks.shape)}")
    if steps < 1 or rho <= 0 or rho_growth < 1.0:
        raise ValueError(f"need steps >= 1, rho > 0, rho_growth >= 1; got {steps}, {rho}, "
                         f"{rho_growth}")  # fmt: skip
    start = time.process_time()
    weights = [linear.weight for linear in prunable_linears(model).values()]
    frozen = [w.requires_grad for w in weights]
    with torch.no_grad():
        z, keep = map(list, zip(*(project_rows(w.float(), sparsity) for w in weights), strict=True))
        u = [torch.zeros_like(zi) for zi in z]
    for w in weights:
        w.requires_grad_(True)
    opt = _optimizer(weights, optimizer, lr)
    losses, gaps = [], []
    try:
        for block in blocks:
            for _ in range(steps):
                opt.zero_grad(set_to_none=True)
                loss = lm_loss(model, block)
                loss.backward()
                if not prox:
                    _add_penalty_grad(weights, z, u, rho)
                opt.step()
                if prox:
                    _penalty_prox(weights, z, u, rho)
            losses.append(float(loss.detach()))
            with torch.no_grad():
                pairs = list(zip(weights, z, strict=True))
                for w, zi, ui, ki in zip(weights, z, u, keep, strict=True):
                    new_z, new_keep = project_rows(w.float() + ui, sparsity)
                    zi.copy_(new_z)
                    ki.copy_(new_keep)
                    ui.add_(w.float() - zi)
                gaps.append(float(sum((w.float() - zi).pow(2).sum() for w, zi in pairs)))
                if rho_growth != 1.0:
                    for ui in u:
                        ui.div_(rho_growth)  # same unscaled dual ρ·U under the new ρ
                    rho *= rho_growth
    finally:
        opt.zero_grad(set_to_none=True)
        for w, was in zip(weights, frozen, strict=True):
            w.requires_grad_(was)
    with torch.no_grad():
        for w, ki in zip(weights, keep, strict=True):
            w.mul_(ki.to(w.dtype))  # hard prune to Z's support: exactly the target sparsity
    parts = extra_state_bytes(weights, optimizer)
    return {
        "blocks_used": len(losses), "tokens": len(losses) * blocks.shape[1], "loss": losses,
        "gap": gaps, "final_rho": rho, "extra_state_bytes": sum(parts.values()),
        "extra_state": parts, "cpu_s": time.process_time() - start,
    }  # fmt: skip
