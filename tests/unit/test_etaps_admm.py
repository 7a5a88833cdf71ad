"""The ELSA-like ADMM baseline on a tiny random Llama: sparsity, budget, projection, loss."""

from __future__ import annotations

import pytest
import torch

from tests.etaps_models import TINY_VOCAB, tiny_llama
from vllm_ext.etaps.admm import extra_state_bytes, project_rows, prune_admm
from vllm_ext.etaps.baselines import prune_one_shot
from vllm_ext.etaps.model_io import prunable_linears
from vllm_ext.etaps.pruner import lm_loss
from vllm_ext.etaps.schedule import pruned_per_row

pytestmark = pytest.mark.unit

VOCAB = TINY_VOCAB
# settings under which ADMM reliably helps on the tiny model (checked over seeds 0-4)
ADMM = {"lr": 1e-2, "rho": 1.0, "rho_growth": 1.2}


def _blocks(seed: int, n: int, length: int = 16) -> torch.Tensor:
    """Learnable text: a random start, then ``t -> 5t + 3 mod VOCAB`` (so training can help)."""
    gen = torch.Generator().manual_seed(seed)
    cols = [torch.randint(0, VOCAB, (n,), generator=gen)]
    for _ in range(length - 1):
        cols.append((cols[-1] * 5 + 3) % VOCAB)
    return torch.stack(cols, 1)


@torch.no_grad()
def _mean_loss(model, blocks) -> float:
    return sum(float(lm_loss(model, b)) for b in blocks) / len(blocks)


def _magnitude_loss(seed: int, sparsity: float, blocks) -> float:
    """The calibration loss of the same model magnitude-pruned: the bar ADMM has to clear."""
    magnitude = tiny_llama(seed)
    prune_one_shot(magnitude, sparsity)
    return _mean_loss(magnitude, blocks)


@pytest.mark.parametrize("seed", range(6))
def test_z_step_equals_plain_per_row_top_k(seed):
    gen = torch.Generator().manual_seed(seed)
    rows, cols = (int(v) for v in torch.randint(1, 120, (2,), generator=gen))
    # both sides of the kept/pruned top-k switch, plus a random sparsity
    sparsity = [0.1, 0.35, 0.5, 0.62, 0.9, 0.05 + 0.9 * float(torch.rand(1, generator=gen))][seed]
    w = torch.randn(rows, cols, generator=gen)
    z, keep = project_rows(w, sparsity)
    n_keep = cols - pruned_per_row(cols, sparsity)
    expected_keep = torch.zeros_like(w, dtype=torch.bool)
    if n_keep:
        expected_keep.scatter_(1, w.abs().topk(n_keep, dim=1).indices, True)
    assert torch.equal(keep, expected_keep)
    assert torch.equal(z, torch.where(expected_keep, w, torch.zeros_like(w)))


@pytest.mark.parametrize("sparsity", [0.5, 0.73, 0.9])
def test_every_prunable_layer_ends_exactly_at_the_target_sparsity(sparsity):
    model = tiny_llama(0)
    stats = prune_admm(model, _blocks(0, 4), sparsity, steps=2, **ADMM)
    for name, linear in prunable_linears(model).items():
        cols = linear.in_features
        nonzero = (linear.weight != 0).sum(1)
        assert (nonzero == cols - pruned_per_row(cols, sparsity)).all(), name
        assert not linear.weight.requires_grad  # frozen again, as load_model leaves it
    weights = [lin.weight for lin in prunable_linears(model).values()]
    n = sum(w.numel() for w in weights)
    assert stats["extra_state_bytes"] == n * 4 * 5  # Z, U, grad, 2 Adam moments (fp32)
    assert extra_state_bytes(weights, "sgd")["optimizer_moments"] == 0


def test_consumes_exactly_the_given_blocks_in_order():
    model = tiny_llama(1)
    blocks = _blocks(1, 5)
    seen = []
    hook = model.model.embed_tokens.register_forward_hook(
        lambda _m, args, _o: seen.append(args[0][0].clone())
    )
    stats = prune_admm(model, blocks, 0.6, steps=3, **ADMM)
    hook.remove()
    assert stats["blocks_used"] == 5 and stats["tokens"] == blocks.numel()
    assert len(stats["loss"]) == len(stats["gap"]) == 5
    assert len(seen) == 5 * 3  # steps optimizer steps per block, no other forward
    for i, ids in enumerate(seen):
        assert torch.equal(ids, blocks[i // 3])


@pytest.mark.parametrize("seed", range(3))
def test_admm_beats_magnitude_and_unconstrained_training_on_the_calibration_loss(seed):
    sparsity, blocks = 0.8, _blocks(seed, 30)
    admm = tiny_llama(seed)
    prune_admm(admm, blocks, sparsity, **ADMM)
    # the same training with a negligible penalty: train dense, then hard-prune
    unconstrained = tiny_llama(seed)
    prune_admm(unconstrained, blocks, sparsity, lr=ADMM["lr"], rho=1e-8)
    loss = _mean_loss(admm, blocks)
    assert loss < _magnitude_loss(seed, sparsity, blocks) - 0.1
    assert loss < _mean_loss(unconstrained, blocks) - 0.05


def test_rejects_bad_arguments():
    model = tiny_llama(2)
    with pytest.raises(ValueError, match="blocks"):
        prune_admm(model, torch.zeros(0, 8, dtype=torch.long), 0.5)
    with pytest.raises(ValueError, match="rho"):
        prune_admm(model, _blocks(2, 1), 0.5, rho=0.0)
    with pytest.raises(ValueError, match="optimizer"):
        prune_admm(model, _blocks(2, 1), 0.5, optimizer="lion")


def test_benchmark_baselines_argument_and_best_any():
    import argparse

    from benchmarks.etaps import quality

    assert "admm" in quality.BASELINES
    assert quality._baselines("sparsegpt, wanda,sparsegpt") == ("sparsegpt", "wanda")
    for bad in ("admm,magnitude", "wanda,elsa"):  # no headline baseline / unknown name
        with pytest.raises(argparse.ArgumentTypeError):
            quality._baselines(bad)
    at = {"etaps": {"ppl": 30.0}, "wanda": {"ppl": 40.0}, "admm": {"ppl": 20.0},
          "magnitude": {"ppl": 50.0}}  # fmt: skip
    assert quality._best_any(at) == {"name": "admm", "ppl": 20.0, "etaps_over_best": 1.5}


@pytest.mark.parametrize("seed", range(2))
def test_prox_w_step_converges_onto_z_and_beats_magnitude(seed):
    sparsity, blocks = 0.8, _blocks(seed, 30)
    admm = tiny_llama(seed)
    stats = prune_admm(admm, blocks, sparsity, lr=1e-2, rho=0.1, rho_growth=1.2, prox=True)
    assert stats["gap"][-1] < 1e-3 * max(stats["gap"])  # W settled on Z: the hard prune is free
    assert _mean_loss(admm, blocks) < _magnitude_loss(seed, sparsity, blocks) - 0.1
