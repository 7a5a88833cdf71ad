"""Compressed mode (token scorer, deletion impact, per-head budgets) on random tiny Llamas."""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks.acct import compressed
from vllm_ext.acct import compress as cm
from vllm_ext.acct.llama import LlamaShape, TorchLlama
from vllm_ext.assets import model_path


def _model(seed: int) -> TorchLlama:
    gen = torch.Generator().manual_seed(seed)
    heads = [2, 4][seed % 2]
    shape = LlamaShape(32, 3, heads * 2, heads, 8, 48, 97, 10000.0, 1e-6, seed % 2 == 0)
    model = TorchLlama(shape)
    for p in model.parameters():
        p.data = torch.randn(p.shape, generator=gen) * 0.3
    return model.eval().requires_grad_(False)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dropping_a_token_from_every_head_equals_a_prefix_without_it(seed):
    model, gen = _model(seed), torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 97, (24,), generator=gen)
    ctx, cont, drop = ids[:18], ids[18:], int(torch.randint(1, 17, (1,), generator=gen))
    cache, _ = cm.prefill(model, ctx, 1)
    keep = torch.ones(cm.head_count(model), 18, dtype=torch.bool)
    keep[:, drop] = False
    dropped = cm.continuation_nll(model, cache, cont, cm.mask_bias(keep, 3))
    kept = [(k[:, keep[0]], v[:, keep[0]]) for k, v in cache]  # same positions, one token gone
    assert torch.allclose(dropped, cm.continuation_nll(model, kept, cont, None, 18), atol=1e-5)
    zero = [torch.zeros(k.shape[0], 18) for k, _ in cache]
    plain = cm.continuation_nll(model, cache, cont, None)
    assert torch.allclose(cm.continuation_nll(model, cache, cont, zero), plain, atol=1e-6)


def test_first_order_impact_predicts_small_deletions():
    model = _model(3).double()
    ids = torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(3))
    cache, _ = cm.prefill(model, ids[:32], 1)
    impact = cm.deletion_impact(model, cache, ids[32:])
    assert impact.shape == (cm.head_count(model), 32)
    # removing a little attention mass (bias -eps) changes the loss by eps * impact
    eps, head, tok = 1e-3, 5, 7
    bias = [torch.zeros(model.shape.num_kv_heads, 32) for _ in cache]
    bias[head // model.shape.num_kv_heads][head % model.shape.num_kv_heads, tok] = -eps
    n = ids[32:].shape[0] - 1
    base = cm.continuation_nll(model, cache, ids[32:], None) * n
    moved = cm.continuation_nll(model, cache, ids[32:], bias) * n
    assert math.isclose(float(moved - base), eps * float(impact[head, tok]), rel_tol=0.02)


def test_keep_mask_honours_budgets_and_sinks():
    scores = torch.rand(6, 50, generator=torch.Generator().manual_seed(0))
    fractions = torch.tensor([0.0, 0.1, 0.2, 0.5, 1.0, 0.3])
    mask = cm.keep_mask(scores, fractions, 4)
    assert mask[:, :4].all()
    assert mask.sum(1).tolist() == [4, 5, 10, 25, 50, 15]
    top = scores[3, 4:].topk(21).indices + 4
    assert mask[3, top].all()


def test_learned_budgets_follow_where_impact_is_and_keep_the_total():
    curves = torch.zeros(3, cm.GRID + 1)
    grid = torch.linspace(0, 1, cm.GRID + 1)
    curves[0], curves[1], curves[2] = 10 * grid.sqrt(), grid, 3 * grid.sqrt()
    budgets = cm.learn_budgets(curves, 0.3)
    assert math.isclose(float(budgets.mean()), 0.3, abs_tol=1 / cm.GRID)
    assert budgets[0] > budgets[2] > budgets[1]


def test_scorer_learns_a_recency_pattern():
    n, heads = 64, 4
    samples = []
    for seed in range(3):
        source = torch.randn(n, 16, generator=torch.Generator().manual_seed(seed))
        samples.append((source, torch.arange(n, dtype=torch.float32).expand(heads, n)))
    scorer = cm.TokenScorer.fit(samples, 1e-6, alpha=1e-4)
    scores = scorer.scores(torch.randn(n, 16))
    rank = torch.corrcoef(torch.stack([scores[0], torch.arange(n, dtype=torch.float32)]))[0, 1]
    assert rank > 0.9


def test_compressed_benchmark_runs_on_tiny_llama():
    result = compressed.run(model_path("tiny-llama"), 64, 12, 2, 2, [0.25, 0.5], 1, 4,
                            progress=lambda _: 0)  # fmt: skip
    assert result.name == "acct_compressed" and result.headline["rounds"] == 1
    assert set(result.series) == {"own", *compressed.POLICIES}
    for points in result.series.values():  # one shared axis: the budgets asked for
        assert [p["kept"] for p in points] == [0.25, 0.5]
    assert all(0 < p["kept_measured"] <= 1 for p in result.series["random"])
    learned = result.config["learned_budgets"]["0.25"]
    assert math.isclose(sum(learned) / len(learned), 0.25, abs_tol=0.03)
