"""HiState vs native / LRU / Marconi in the calibrated simulator, on the same saved traces.

Simulated instance: a 7B-class Gated-DeltaNet hybrid on one H200 with an NVMe
SSD (cost model and sources: ``vllm_ext.histate.costmodel``; all numbers are
assumptions from published figures, none measured here). Traces: aiperf's
agentic-coding sessions (scale 0.5: contexts up to 100k tokens, 512-token
blocks) and BFCL v4 multi-turn tool use (256-token blocks), generated once
with seed 0, saved as JSONL and loaded back, at several session arrival
rates. Every variant replays the same trace; the policies are the classes
the vLLM connector uses:

- ``native``: vLLM's own device-only align-mode caching (one LRU over KV
  blocks and snapshots, no host/SSD tier);
- ``marconi_device``: Marconi as published (device memory only, its
  admission and eviction instead of vLLM's), the paper's "Marconi on vLLM";
- ``lru``, ``marconi``, ``histate``: the device tier plus host memory (KV +
  snapshots in one queue) and SSD (snapshots) under that policy.

Ablations at the headline load: HiState's weight ``w`` (0 = plain recency
on the GreedyDual clock; every ``w > 0`` should give the same order), the
issue's literal score ``(last access s + w * recompute s) / MiB`` on the
wall clock (``histate_issue_score``: what HiState used before the GreedyDual
loss score), HiState with unbounded host memory (``histate_unbounded_host``:
nothing is ever evicted, the floor any eviction policy can reach on these
tiers), HiState without releasing the device copies of the
snapshots it holds (``histate_keep_device``: vLLM's device pool keeps its own
align-mode snapshots, as without ``vllm_ext.histate.device_pool``), and
Marconi's ``alpha`` (its paper tunes it per workload). Headline: HiState vs
the best-alpha Marconi, p99 TTFT, agentic trace, at the highest swept load at
which Marconi's (alpha=1) median TTFT stays under 1 s (the load the baseline
still sustains; rule fixed before looking at HiState's numbers).

The simulation is deterministic (seeded traces, no other randomness): one
round is the whole measurement, recorded as ``rounds: 1``.

Run: ``python -m benchmarks.histate.sim`` (~5 min on 2 cores; ``--quick``: ~30 s).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from vllm_ext.bench import (
    OUT_DIR,
    BenchResult,
    collect_fingerprint,
    command_line,
    headline_from_rounds,
    headline_text,
    write_result,
)
from vllm_ext.histate.config import HiStateConfig
from vllm_ext.histate.costmodel import GB, CostModel
from vllm_ext.histate.policy import MIB, HiStatePolicy, Item
from vllm_ext.histate.simulator import VARIANTS, simulate
from vllm_ext.histate.traces import agentic_trace, bfcl_trace, load_trace, save_trace

NAME = "histate_sim"
METRIC = "ttft_p99_s"
TARGET = "ratio <= 0.333 (>= 3x lower p99 TTFT than Marconi; paper: up to 5.73x)"
COST = CostModel(device_bytes=20 * GB, host_bytes=40 * GB, ssd_bytes=1000 * GB)
TRACES = {
    # name: (generator, kwargs, session rates)
    "agentic": (agentic_trace, dict(n_sessions=300, scale=0.5, block_size=512), (0.15, 0.2, 0.25)),
    "bfcl": (bfcl_trace, dict(n_sessions=600, block_size=256), (2.0, 4.0, 6.0)),
}
WEIGHTS = (0.0, 1.0, 1000.0)
ALPHAS = (0.0, 0.5, 1.0, 2.0, 4.0)
KEEP_DEVICE = "histate_keep_device"  # ablation: HiState without releasing device snapshot copies
ISSUE_SCORE = "histate_issue_score"  # ablation: the issue's literal wall-clock score
# bound: host memory never full, so no eviction policy can do better with these tiers
UNBOUNDED = "histate_unbounded_host"
ABLATIONS = (KEEP_DEVICE, ISSUE_SCORE, UNBOUNDED)


class IssueScorePolicy(HiStatePolicy):
    """The issue's literal score, ``(last access s + w * recompute s) / MiB`` (ablation only).

    An absolute time divided by bytes: the order depends on when the clock
    started (the larger kind of item goes first more and more strongly).
    """

    def score(self, item: Item, clock: float = 0.0, spills: bool = False) -> float:
        credit = self.config.time_weight * self.recompute_seconds(item)
        return (item.last_access + credit) / (item.nbytes / MIB)


SHOWN = ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "ttft_mean_s", "token_hit_rate",
         "hit_rate_device", "hit_rate_host", "hit_rate_ssd", "miss_rate", "recomputed_tokens",
         "host_kv_read_GB", "host_snapshot_read_GB", "ssd_snapshot_read_GB", "ssd_write_GB",
         "spills_dropped", "device_snapshots_released", "utilization")  # fmt: skip


def _shown(metrics: dict[str, Any]) -> dict[str, Any]:
    out = dict(metrics)
    for key in ("host_kv_read", "host_snapshot_read", "ssd_snapshot_read", "ssd_write"):
        out[f"{key}_GB"] = out.pop(f"{key}_bytes") / GB
    return {k: out[k] for k in SHOWN}


def make_traces(trace_dir: Path, quick: bool) -> dict[tuple[str, float], Path]:
    """Generate every (trace, rate) once and save it; the paths."""
    paths = {}
    for name, (gen, kwargs, rates) in TRACES.items():
        kwargs = dict(kwargs)
        if quick:
            kwargs["n_sessions"] //= 6
        for rate in rates:
            path = trace_dir / f"{name}_rate{rate:g}_seed0.jsonl"
            paths[(name, rate)] = save_trace(gen(seed=0, session_rate=rate, **kwargs), path)
    return paths


def variant_setup(variant: str, knob: float) -> tuple[HiStateConfig, CostModel, type | None]:
    """The policy config, cost model and policy class one simulated variant runs with."""
    cfg = HiStateConfig(marconi_alpha=knob)
    if variant == "histate":  # the device-pool release is modelled for HiState
        cfg = HiStateConfig(time_weight=knob, release_device_snapshots=True)
    if variant == KEEP_DEVICE:  # ablation: snapshots keep their device copies
        cfg = HiStateConfig(release_device_snapshots=False)
    policy_cls = IssueScorePolicy if variant == ISSUE_SCORE else None
    cost = dataclasses.replace(COST, host_bytes=10**15) if variant == UNBOUNDED else COST
    return cfg, cost, policy_cls


def variant_config(variant: str, knob: float) -> dict[str, Any]:
    """What :func:`variant_setup` gives, JSON-ready (every field of the resolved config)."""
    cfg, cost, policy_cls = variant_setup(variant, knob)
    base = COST.describe()
    return {
        "simulated_policy": "histate" if variant in ABLATIONS else variant,
        "policy_class": (policy_cls or HiStatePolicy).__name__,
        "histate": dataclasses.asdict(cfg),
        # config.cost_model holds the shared model; a variant records only what it changes
        "cost_model_changes": {k: v for k, v in cost.describe().items() if base.get(k) != v},
    }


def run(trace_paths) -> tuple[dict, dict, dict, float]:
    """Every variant on every saved trace, then the ablations at the headline load.

    Returns:
        ``(results, seconds, sizes, head)``: metrics keyed by
        ``(trace, rate, variant, knob)`` (knob = ``w`` for histate, ``alpha``
        for marconi, 1.0 otherwise), simulation seconds, requests per trace,
        the headline rate.
    """
    loaded = {key: load_trace(path) for key, path in trace_paths.items()}
    results: dict[tuple[str, float, str, float], dict] = {}
    seconds: dict[str, float] = {}

    def sim(key, variant, knob):
        start = time.perf_counter()
        cfg, cost, policy_cls = variant_setup(variant, knob)
        results[(*key, variant, knob)] = simulate(
            loaded[key], cost, "histate" if variant in ABLATIONS else variant, cfg, policy_cls
        )
        seconds[f"{key[0]}@{key[1]:g}/{variant}/{knob:g}"] = time.perf_counter() - start

    for key, variant in tqdm([(k, v) for k in loaded for v in VARIANTS], desc="histate sim"):
        sim(key, variant, 1.0)
    head = headline_rate(results, sorted(r for t, r in loaded if t == "agentic"))
    ablations = [("histate", w) for w in WEIGHTS if w != 1.0]
    ablations += [("marconi", a) for a in ALPHAS if a != 1.0]
    ablations += [(v, 1.0) for v in ABLATIONS]
    for variant, knob in tqdm(ablations, desc="histate ablations"):
        sim(("agentic", head), variant, knob)
    sizes = {f"{k[0]}@{k[1]:g}": len(t.requests) for k, t in loaded.items()}
    return results, seconds, sizes, head


def headline_rate(results, rates) -> float:
    """Highest agentic rate where Marconi's median TTFT < 1 s (else the lowest rate)."""
    ok = [r for r in rates if results[("agentic", r, "marconi", 1.0)]["ttft_p50_s"] < 1.0]
    return max(ok) if ok else min(rates)


def best_marconi(results, head) -> tuple[float, dict]:
    """Marconi's alpha with the lowest p99 TTFT at the headline load (the strongest baseline)."""
    runs = {k[3]: m for k, m in results.items() if k[:3] == ("agentic", head, "marconi")}
    alpha = min(runs, key=lambda a: runs[a][METRIC])
    return alpha, runs[alpha]


def build_result(results, seconds, sizes, head, args) -> BenchResult:
    rates = {name: sorted({k[1] for k in results if k[0] == name}) for name in TRACES}
    mid_bfcl = rates["bfcl"][len(rates["bfcl"]) // 2]
    variants: dict[str, dict] = {}
    configs: dict[str, dict] = {}
    for trace, rate in (("agentic", head), ("bfcl", mid_bfcl)):
        for v in VARIANTS:
            variants[f"{trace}@{rate:g}:{v}"] = _shown(results[(trace, rate, v, 1.0)])
            configs[f"{trace}@{rate:g}:{v}"] = variant_config(v, 1.0)
    for (trace, rate, v, knob), m in sorted(results.items()):
        name = f"{trace}@{rate:g}:{v}"
        if v not in ABLATIONS and knob != 1.0:
            name += f"({'w' if v == 'histate' else 'alpha'}={knob:g})"
        elif v not in ABLATIONS:
            continue
        variants[name], configs[name] = _shown(m), variant_config(v, knob)
    series = {}
    for trace in TRACES:
        for v in VARIANTS:
            series[f"{trace}:{v}"] = [
                {"session_rate": r, **_shown(results[(trace, r, v, 1.0)])} for r in rates[trace]
            ]
    ours = results[("agentic", head, "histate", 1.0)][METRIC]
    alpha, marconi = best_marconi(results, head)
    base = marconi[METRIC]
    return BenchResult(
        name=NAME,
        description=describe(results, rates, head, ours / base, alpha),
        variants=variants,
        headline=headline_from_rounds(
            f"agentic@{head:g} {METRIC}",
            [ours],
            [base],
            f"marconi(alpha={alpha:g})",
            higher_is_better=False,
            target=TARGET,
        ),
        fingerprint=collect_fingerprint(),
        command=command_line("benchmarks.histate.sim", args.argv),
        variant_configs=configs,
        config={
            "cost_model": COST.describe(),
            "policy_config": dataclasses.asdict(HiStateConfig()),
            "traces": {k: {**v[1], "rates": v[2], "seed": 0} for k, v in TRACES.items()},
            "requests_per_trace": sizes,
            "weights": list(WEIGHTS),
            "alphas": list(ALPHAS),
            "quick": args.quick,
            "headline_rate": head,
            "headline_rule": "highest agentic rate with Marconi (alpha=1) p50 TTFT < 1 s; "
            "baseline = Marconi with the best alpha there",
            "sim_seconds": seconds,
        },
        series=series,
        sweep_axis="session_rate",
        plot_metric=METRIC,
    )


def describe(results, rates, head, ratio, alpha) -> str:
    """Top of the markdown: what ran and an honest verdict on the target."""
    per_rate = []
    for trace in TRACES:
        for r in rates[trace]:
            ours = results[(trace, r, "histate", 1.0)][METRIC]
            base = results[(trace, r, "marconi", 1.0)][METRIC]
            per_rate.append(f"{trace}@{r:g}: {base / ours:.2f}x")
    met = "met" if ratio <= 1 / 3 else "NOT met"
    at_head = {k[2:]: m for k, m in results.items() if k[:2] == ("agentic", head)}
    ours = at_head[("histate", 1.0)][METRIC]
    device = at_head[("marconi_device", 1.0)]
    saturated = [v for (v, knob), m in at_head.items() if knob == 1.0 and m["ttft_p50_s"] > 1.0]
    keep, issue = at_head.get((KEEP_DEVICE, 1.0)), at_head.get((ISSUE_SCORE, 1.0))
    keep_text = (f" Without releasing device snapshot copies: p99 {keep[METRIC]:.3g}s "
                 f"(with: {ours:.3g}s)." if keep else "")  # fmt: skip
    if issue:
        keep_text += f" With the issue's literal wall-clock score: p99 {issue[METRIC]:.3g}s."
    bound = at_head.get((UNBOUNDED, 1.0))
    if bound:
        keep_text += (
            f" With unbounded host memory (no eviction at all: the floor for any eviction "
            f"policy on these tiers): p99 {bound[METRIC]:.3g}s."
        )
    weights = ", ".join(f"w={k:g}: {m[METRIC]:.3g}s" for (v, k), m in sorted(at_head.items())
                        if v == "histate")  # fmt: skip
    return (
        f"{__doc__.split(chr(10) + chr(10))[0]}\n\n{__doc__.split(chr(10) + chr(10), 1)[1]}\n"
        f"**Verdict:** at the headline load (agentic, {head:g} sessions/s) HiState's p99 TTFT is "
        f"{1 / ratio:.2f}x lower than the best-tuned Marconi's with the same tiers "
        f"(alpha={alpha:g}; target >= 3x: {met}) and {device[METRIC] / ours:.1f}x lower than "
        f"device-only Marconi (as published). Variants whose median TTFT exceeds 1 s at this "
        f"load (saturated: their queue grows through the trace, so ratios against them measure "
        f"overload, not steady state): {', '.join(saturated) or 'none'}. HiState p99 by time "
        f"weight: {weights}.{keep_text} Marconi(alpha=1, same tiers)-over-HiState p99 ratio "
        f"at every swept load: {', '.join(per_rate)}. All of it is simulated (cost-model "
        "assumptions, not H200 measurements)."
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1/6 of the sessions: a smoke run")
    parser.add_argument("--trace-dir", default="tmp/histate_traces")
    parser.add_argument("--out", default=OUT_DIR)
    args = parser.parse_args(argv)
    args.argv = argv
    paths = make_traces(Path(args.trace_dir), args.quick)
    results, seconds, sizes, head = run(paths)
    result = build_result(results, seconds, sizes, head, args)
    write_result(result, args.out)
    h = result.headline
    sys.stdout.write(headline_text(h, "histate"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
