"""Compressed mode: continuation NLL vs the share of KV kept, per-head token dropping (torch).

SmolLM2-135M over the target's own KV of ``context`` tokens; every KV head
keeps its own token subset (the 4 sink tokens always). Policies, at equal kept
KV (the mean keep fraction over all 90 KV heads):

- ``scorer_learned``: the token scorer (ridge on the source's layer-k states,
  trained on first-order deletion impact) with learned per-head budgets;
- ``scorer_uniform``: the same scorer, the same fraction for every head;
- ``random``: a random subset per head; ``recency``: the last tokens (StreamingLLM);
- ``oracle``: the held-out window's own deletion impact (an upper bound, not
  deployable).

Training windows come from training conversations, evaluation windows from
held-out ones. Headline: NLL with the learned scorer at 25 % kept vs own
prefill (the paper's "-75 % KV at equal quality").
"""

from __future__ import annotations

import statistics

import torch
from transformers import AutoTokenizer

from vllm_ext.acct import compress as cm
from vllm_ext.acct.data import eval_windows, train_windows
from vllm_ext.acct.llama import TorchLlama
from vllm_ext.bench import BenchResult, collect_fingerprint, headline_from_rounds

POLICIES = ("scorer_learned", "scorer_uniform", "random", "recency", "oracle")


def _window(target, window, source_layers):
    ctx = torch.as_tensor(window.context, dtype=torch.long)
    cont = torch.as_tensor(window.continuation, dtype=torch.long)
    cache, source = cm.prefill(target, ctx, source_layers)
    return cache, source, cont


def run(model_dir, context: int, continuation: int, train: int, windows: int,
        fractions: list[float], source_layers: int, sink_tokens: int,
        progress=print) -> BenchResult:  # fmt: skip
    torch.set_num_threads(1)
    target = TorchLlama.from_pretrained(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    eps, layers = target.shape.rms_norm_eps, target.shape.num_layers
    stream = train_windows(tok, context, continuation, 200, seed=7)
    samples = []
    for i in range(train):
        cache, source, cont = _window(target, next(stream), source_layers)
        samples.append((source, cm.deletion_impact(target, cache, cont)))
        progress(f"train window {i + 1}/{train}: impact measured")
    scorer = cm.TokenScorer.fit(samples, eps)
    curves = sum(cm.retained_curves(scorer.scores(s), imp) for s, imp in samples)
    budgets = {f: cm.learn_budgets(curves, f) for f in fractions}
    heads = cm.head_count(target)
    per_window = []
    for w, window in enumerate(eval_windows(tok, context, continuation, windows)):
        cache, source, cont = _window(target, window, source_layers)
        with torch.no_grad():
            own = float(cm.continuation_nll(target, cache, cont, None))
        scores = {
            "scorer_learned": scorer.scores(source),
            "random": cm.baseline_scores("random", heads, context, seed=w),
            "recency": cm.baseline_scores("recency", heads, context, seed=w),
            "oracle": cm.deletion_impact(target, cache, cont),
        }
        scores["scorer_uniform"] = scores["scorer_learned"]
        row = {"own": own}
        for f in fractions:
            for policy in POLICIES:
                frac = budgets[f] if policy == "scorer_learned" else torch.full((heads,), f)
                mask = cm.keep_mask(scores[policy], frac, sink_tokens)
                with torch.no_grad():
                    nll = cm.continuation_nll(target, cache, cont, cm.mask_bias(mask, layers))
                row[f"{policy}@{f}"] = float(nll)
                row[f"kept@{policy}@{f}"] = float(mask.float().mean())
        per_window.append(row)
        first = ", ".join(f"{p} {row[f'{p}@{fractions[0]}']:.3f}" for p in POLICIES)
        progress(f"eval window {w + 1}/{windows}: own {own:.3f}; at {fractions[0]}: {first}")
    return _result(model_dir, per_window, fractions, budgets, context, continuation, train,
                   source_layers, sink_tokens)  # fmt: skip


def _result(model_dir, per_window, fractions, budgets, context, continuation, train,
            source_layers, sink_tokens) -> BenchResult:  # fmt: skip
    mean = lambda key: statistics.fmean(w[key] for w in per_window)  # noqa: E731
    variants = {"own": {"nll": mean("own")}}
    series = {"own": [{"kept": f, "nll": mean("own")} for f in fractions]}
    for policy in POLICIES:
        series[policy] = []
        for f in fractions:
            values = [w[f"{policy}@{f}"] for w in per_window]
            # the axis is the budget (shared by every policy, so the plot's categories line up);
            # the share each policy really kept (budgets round per head) is its own column
            point = {"kept": f, "kept_measured": mean(f"kept@{policy}@{f}"),
                     "nll": statistics.fmean(values), "nll_min": min(values),
                     "nll_max": max(values)}  # fmt: skip
            series[policy].append(point)
            variants.setdefault(policy, {})[f"nll_{f}"] = point["nll"]
    head = 0.25 if 0.25 in fractions else fractions[0]
    # deterministic (no timing): one round is the measurement
    headline = headline_from_rounds(
        f"continuation NLL (nats/token) keeping {head:.0%} of the KV per head "
        f"(scorer + learned budgets) vs all of it, {context}-token context",
        [variants["scorer_learned"][f"nll_{head}"]],
        [variants["own"]["nll"]],
        "own",
        higher_is_better=False,
        target="ratio <= 1.01",
    )
    return BenchResult(
        name="acct_compressed",
        description=__doc__.strip().splitlines()[0],
        variants=variants,
        headline=headline,
        fingerprint=collect_fingerprint(),
        config={
            "model": str(model_dir),
            "context": context,
            "continuation": continuation,
            "train_windows": train,
            "eval_windows": len(per_window),
            "fractions": fractions,
            "source_layers": source_layers,
            "sink_tokens": sink_tokens,
            "learned_budgets": {str(f): b.tolist() for f, b in budgets.items()},
            "per_window": per_window,
        },  # fmt: skip
        series=series,
        sweep_axis="kept",
        plot_metric="nll",
    )
