"""Continuation quality over an imported cache vs own prefill, truncation and no context.

Held-out ShareGPT conversations (never used for fitting), first ``context``
tokens as the cache, next ``continuation`` tokens decoded by SmolLM2-135M over
it. Same windows, one run, for every variant:

- ``own``: the target's own prefill (reference);
- ``acct:<name>``: each checkpoint's import (first k layers + converters +
  exact sinks, optionally an exact tail: ``NAME=FOLDER:TAIL``), e.g. the ridge
  initialisation and the KL-trained converters;
- ``truncated:<N>``: own prefill of the last N context tokens only, N matched
  to the import's compute (k * context + (L - k) * sinks layer-tokens);
- ``no_context``.

Metrics: NLL of the continuation (nats/token), top-1 agreement with own
prefill, KL to own prefill; mean, min and max over windows.
Headline: the first checkpoint's NLL vs own prefill (target: within 1 % and
below truncation at equal compute).
"""

from __future__ import annotations

import statistics

import torch
from transformers import AutoTokenizer

from vllm_ext.acct.checkpoint import load_pipeline
from vllm_ext.acct.data import eval_windows
from vllm_ext.acct.llama import TorchLlama
from vllm_ext.acct.needle import exact_match, needle_set, score_needles
from vllm_ext.acct.quality import equal_compute_tokens, gate_report, score_variants
from vllm_ext.bench import BenchResult, collect_fingerprint, headline_from_rounds


def gate_of(result: BenchResult, name: str, max_delta_nll: float, min_top1: float) -> dict:
    """The offline gate of checkpoint ``name`` from this benchmark's own measurements."""
    v, c = result.variants, result.config
    keep = c["equal_compute_tokens"][name]
    means = {"own": v["own"], "acct": v[f"acct:{name}"], "truncated": v[f"truncated:{keep}"]}
    settings = {"context": c["context"], "continuation": c["continuation"],
                "measured_by": "benchmarks.acct quality"}  # fmt: skip
    report = {"means": means, "windows": c["per_window"]}
    return gate_report(report, max_delta_nll, min_top1, settings)


def run(model_dir, checkpoints: dict[str, str], windows: int, context: int,
        continuation: int, progress=print, needles: int = 0) -> BenchResult:  # fmt: skip
    torch.set_num_threads(1)
    target = TorchLlama.from_pretrained(model_dir)
    pipelines = {}
    for name, spec in checkpoints.items():
        path, _, tail = spec.partition(":")
        pipelines[name] = load_pipeline(path, model_dir, target, int(tail) if tail else None)[0]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    data = eval_windows(tokenizer, context, continuation, windows)
    per_window = []
    for i, window in enumerate(data):
        scores = score_variants(target, window, pipelines)
        per_window.append({name: vars(score) for name, score in scores.items()})
        progress(f"window {i + 1}/{len(data)}: " + ", ".join(
            f"{name} {score.nll:.3f}" for name, score in scores.items()))  # fmt: skip
    variants = {}
    for name in per_window[0]:
        row = {}
        for metric in ("nll", "top1", "kl"):
            values = [w[name][metric] for w in per_window]
            row[metric] = statistics.fmean(values)
            row[f"{metric}_min"], row[f"{metric}_max"] = min(values), max(values)
        variants[name] = row
    needle_rows = _needles(target, tokenizer, pipelines, context, needles, variants, progress)
    first = next(iter(checkpoints))
    keep = equal_compute_tokens(pipelines[first], context)
    truncated = variants[f"truncated:{keep}"]["nll"]
    # deterministic (no timing): one round is the measurement
    headline = headline_from_rounds(
        f"continuation NLL (nats/token) over a {context}-token imported cache vs own prefill "
        f"(truncation to {keep} tokens at equal compute: {truncated:.3f})",
        [variants[f"acct:{first}"]["nll"]],
        [variants["own"]["nll"]],
        "own",
        higher_is_better=False,
        target="ratio <= 1.01 and below truncated at equal compute",
    )
    return BenchResult(
        name="acct_quality",
        description=__doc__.strip().splitlines()[0],
        variants=variants,
        headline=headline,
        fingerprint=collect_fingerprint(),
        config={
            "model": str(model_dir),
            "checkpoints": checkpoints,
            "windows": len(data),
            "context": context,
            "continuation": continuation,
            "equal_compute_tokens": {
                n: equal_compute_tokens(p, context) for n, p in pipelines.items()
            },
            "tail_tokens": {n: p.tail_tokens for n, p in pipelines.items()},
            "window_ids": [w.conversation_id for w in data],
            "per_window": per_window,
            "needles": needle_rows,
        },  # fmt: skip
        plot_metric="nll",
    )


def _needles(target, tokenizer, pipelines, context, count, variants, progress) -> list[dict]:
    """Score the needle set; adds ``needle_exact_match`` to every variant in ``variants``."""
    if count <= 0:
        return []
    items = needle_set(tokenizer, context, count)
    keep = {n: equal_compute_tokens(p, context) for n, p in pipelines.items()}

    def done(i, row):
        for name, ids in row["answers"].items():
            text = tokenizer.decode(ids)
            row["answers"][name] = {"text": text, "exact": exact_match(text, row["code"])}
        marks = ", ".join(
            f"{n} {'ok' if a['exact'] else 'miss'}" for n, a in row["answers"].items()
        )
        progress(f"needle {i + 1}/{len(items)} (code {row['code']} at {row['depth']}): {marks}")

    rows = score_needles(target, pipelines, items, keep, progress=done)
    for name, row in variants.items():
        row["needle_exact_match"] = statistics.fmean(r["answers"][name]["exact"] for r in rows)
    for tokens in keep.values():
        # how many needles truncation could see at all: those inside its last tokens
        inside = [r["depth"] >= r["context"] - tokens for r in rows]
        variants[f"truncated:{tokens}"]["needle_in_window"] = statistics.fmean(inside)
    return rows
