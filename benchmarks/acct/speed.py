"""Import cost vs the target's own prefill, in single-thread CPU-seconds (torch, fp32).

Both sides run the same torch Llama code on the same tokens, one torch thread,
timed with ``time.process_time`` (robust to the contended 2-core machine;
acct.md §2 checked that this matches the whole-model cost within 2-12 %):

- ``own_prefill``: all L layers over the context (no LM head);
- ``acct_import``: the first k layers over the context, the remaining layers
  over the sink tokens, and every converter (what the connector's worker runs).

Headline: the speed-up (own / import) at the longest context, target >= 6.5x.
"""

from __future__ import annotations

import copy
import statistics
import time

import torch

from vllm_ext.acct.checkpoint import load_pipeline
from vllm_ext.acct.converter import Converters
from vllm_ext.acct.llama import TorchLlama
from vllm_ext.acct.pipeline import AcctPipeline
from vllm_ext.acct.quality import equal_compute_tokens
from vllm_ext.bench import BenchResult, collect_fingerprint, headline_from_rounds


@torch.no_grad()
def own_prefill_layers(target: TorchLlama, ids: torch.Tensor) -> None:
    cos_sin = target.cos_sin(torch.arange(ids.shape[0]))
    hidden = target.embed(ids)
    for i in range(target.shape.num_layers):
        hidden = target.layer(i, hidden, cos_sin, None).hidden


@torch.no_grad()
def acct_import(pipeline: AcctPipeline, ids: torch.Tensor) -> None:
    state = pipeline.run_source(ids)
    for _ in pipeline.layers(state):
        pass


def _cpu_seconds(fn, *args) -> float:
    started = time.process_time()
    fn(*args)
    return time.process_time() - started


def run(model_dir, checkpoint: str | None, contexts: list[int], rounds: int,
        source_layers: int, sink_tokens: int, progress=print) -> BenchResult:  # fmt: skip
    """The result over every context (see :func:`run_incremental`)."""
    results = list(run_incremental(model_dir, checkpoint, contexts, rounds, source_layers,
                                   sink_tokens, progress))  # fmt: skip
    return results[-1]


def run_incremental(model_dir, checkpoint: str | None, contexts: list[int], rounds: int,
                    source_layers: int, sink_tokens: int, progress=print):  # fmt: skip
    """Yield the result so far after each context (a long run leaves evidence as it goes)."""
    torch.set_num_threads(1)
    target = TorchLlama.from_pretrained(model_dir)
    if checkpoint:
        pipeline, _ = load_pipeline(checkpoint, model_dir, target)
    else:  # the cost does not depend on the converter weights
        pipeline = AcctPipeline(target, Converters(target.shape, source_layers), sink_tokens)
    gen = torch.Generator().manual_seed(0)
    ids_all = torch.randint(100, 40000, (max(contexts),), generator=gen)
    variants: dict[str, dict] = {"own_prefill": {}, "acct_import": {}}
    series: dict[str, list[dict]] = {"own_prefill": [], "acct_import": []}
    equal_compute = {}
    for n in contexts:
        ids = ids_all[:n]
        own, imp = [], []
        for r in range(rounds):
            own.append(_cpu_seconds(own_prefill_layers, target, ids))
            imp.append(_cpu_seconds(acct_import, pipeline, ids))
            progress(f"context {n} round {r + 1}: own {own[-1]:.2f} s, import {imp[-1]:.2f} s")
        med_own, med_imp = statistics.median(own), statistics.median(imp)
        for name, values, med in (("own_prefill", own, med_own), ("acct_import", imp, med_imp)):
            point = {"context": n, "cpu_s": med, "cpu_s_min": min(values),
                     "cpu_s_max": max(values), "tokens_per_cpu_s": n / med,
                     "cpu_s_rounds": values}  # fmt: skip
            series[name].append(point)
            variants[name][f"cpu_s_{n}"] = med
        variants["acct_import"][f"speedup_{n}"] = med_own / med_imp
        equal_compute[n] = equal_compute_tokens(pipeline, n)
        yield _result(model_dir, checkpoint, pipeline, rounds, variants, series, equal_compute)


def _result(model_dir, checkpoint, pipeline, rounds, variants, series, equal_compute):
    variants, series = copy.deepcopy(variants), copy.deepcopy(series)
    contexts = [p["context"] for p in series["own_prefill"]]
    longest = max(contexts)
    for name in variants:
        variants[name]["tokens_per_cpu_s"] = longest / variants[name][f"cpu_s_{longest}"]
    # rounds of own prefill and import alternate: round i of each is one paired round
    per_round = {name: [longest / t for t in series[name][-1]["cpu_s_rounds"]] for name in series}
    headline = headline_from_rounds(
        f"context tokens per single-thread CPU-second at {longest} tokens (import vs own prefill)",
        per_round["acct_import"],
        per_round["own_prefill"],
        "own_prefill",
        higher_is_better=True,
        target=6.5,
    )
    return BenchResult(
        name="acct",
        description=__doc__.strip().splitlines()[0],
        variants=variants,
        headline=headline,
        fingerprint=collect_fingerprint(),
        config={
            "model": str(model_dir),
            "checkpoint": checkpoint,
            "contexts": contexts,
            "rounds": rounds,
            "source_layers": pipeline.source_layers,
            "sink_tokens": pipeline.sink_tokens,
            "torch_threads": 1,
            "dtype": "float32",
            "timer": "time.process_time",
            "equal_compute_tokens": equal_compute,
        },  # fmt: skip
        series=series,
        sweep_axis="context",
        plot_metric="cpu_s",
    )
