"""HiState vs vLLM's own LRU / ARC and Marconi in the calibrated simulator, over trace seeds.

Simulated instance: a 7B-class Gated-DeltaNet hybrid on one H200 with an NVMe
SSD (cost model and sources: ``vllm_ext.histate.costmodel``; all numbers are
assumptions from published figures, none measured here). Traces: aiperf's
agentic-coding sessions (scale 0.5: contexts up to 100k tokens, 512-token
blocks) and BFCL v4 multi-turn tool use (256-token blocks), generated with
seeds 0, 1 and 2, saved as JSONL and loaded back, at several session arrival
rates. Every variant replays the same traces with the same tiers (device pool,
host memory for KV + snapshots in one queue, SSD for snapshots):

- ``native``: vLLM's own device-only align-mode caching (one LRU over KV
  blocks and snapshots, no host/SSD tier);
- ``vllm_lru``, ``vllm_arc``: the host and SSD tiers ordered by **vLLM's own**
  ``LRUCachePolicy`` / ``ARCCachePolicy`` classes (vllm/v1/kv_offload/cpu/policies/,
  driven through ``benchmarks.histate.vllm_policies``), every snapshot admitted:
  vLLM's native offloading policies with the same tiers; ``vllm_lru_t2``,
  ``vllm_arc_t2``: the same behind vLLM's ``store_threshold=2`` admission filter (a chunk
  is stored on its second offer, as ``CPUOffloadingManager`` does), vLLM's knob against
  one-off chunks flooding the tier;
- ``marconi``: Marconi's admission (branch points, last decoded token) and its
  eviction score (recency + alpha * FLOP efficiency) on the same tiers;
- ``histate``: HiState's policy (GreedyDual on the loss of a future hit);
- ``floor``: HiState with unbounded host memory: nothing is ever evicted from
  host memory, so no eviction policy can do better on these tiers (the
  no-eviction floor: what any policy could still gain).

Ablations at the headline load: Marconi's ``alpha`` on every seed (its paper
tunes it per workload; the best alpha competes as the Marconi baseline), and on
seed 0 HiState's weight ``w`` (0 = plain recency on the GreedyDual clock), the
issue's literal score ``(last access s + w * recompute s) / MiB`` on the wall
clock (``histate_issue_score``), and HiState without releasing the device copies
of the snapshots it holds (``histate_keep_device``). Headline: HiState's p99
TTFT vs the best of {vLLM LRU, vLLM ARC (each with store_threshold 0 and 2), Marconi
(best alpha)}, median over the seeds, agentic trace, at the highest swept load at
which that baseline's median TTFT stays under 1 s (rule fixed before looking at
HiState's numbers). Target:
>= 3x lower, or, where the floor itself is less than 3x below the baseline,
within 10 % of the floor.

The simulation is deterministic (seeded traces, no other randomness): each
seed is one round; the spread is across seeds (different traces), not noise.

Run: ``python -m benchmarks.histate.sim`` (~5 min of CPU on an idle machine, in
``--workers`` processes; ``--quick``: 1/6 of the sessions; ``--ablations``: the seed-0
ablations too). The earlier single-seed result swept agentic 0.15-0.25 and BFCL 2-6
sessions/s and Marconi alpha up to 4 (0.2 was its headline load: the baseline saturates
at 0.25; alpha 2 and 4 were far worse); the shared machine (load ~30 on 2 cores) left
time for only this load over 3 seeds.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from tqdm import tqdm

from benchmarks.histate.vllm_policies import VllmArcPolicy, VllmLruPolicy, with_store_threshold
from vllm_ext.bench import (
    OUT_DIR,
    BenchResult,
    collect_fingerprint,
    command_line,
    headline_from_rounds,
    headline_text,
    median_metrics,
    write_result,
)
from vllm_ext.histate.config import HiStateConfig
from vllm_ext.histate.costmodel import GB, CostModel
from vllm_ext.histate.policy import MIB, HiStatePolicy, Item
from vllm_ext.histate.simulator import simulate
from vllm_ext.histate.traces import agentic_trace, load_trace, save_trace

NAME = "histate_sim"
METRIC = "ttft_p99_s"
TARGET = (
    "ratio <= 0.333 (>= 3x lower p99 TTFT than the best of vLLM LRU, vLLM ARC (store_threshold "
    "0 or 2) and Marconi; "
    "where the no-eviction floor is less than 3x below that baseline: within 10% of the floor)"
)
COST = CostModel(device_bytes=20 * GB, host_bytes=40 * GB, ssd_bytes=1000 * GB)
SEEDS = (0, 1, 2)
TRACES = {
    # name: (generator, kwargs, session rates)
    # one load (the earlier sweep's headline load, 0.15-0.25 swept there): 3 seeds of every
    # variant had to fit a shared, overloaded 2-core machine
    "agentic": (agentic_trace, dict(n_sessions=300, scale=0.5, block_size=512), (0.2,)),
}
FLOOR = "floor"  # HiState with unbounded host memory: no eviction at all
# vLLM's LRU/ARC as shipped (store every offered chunk) and behind its store_threshold=2
# admission filter (store a chunk on its second offer): their best configuration competes
MAIN = ("native", "vllm_lru", "vllm_arc", "vllm_lru_t2", "vllm_arc_t2", "marconi", "histate", FLOOR)
BASELINES = ("vllm_lru", "vllm_arc", "vllm_lru_t2", "vllm_arc_t2", "marconi")
VLLM_CLASSES = {
    "vllm_lru": VllmLruPolicy,
    "vllm_arc": VllmArcPolicy,
    "vllm_lru_t2": with_store_threshold(VllmLruPolicy, 2),
    "vllm_arc_t2": with_store_threshold(VllmArcPolicy, 2),
}
WEIGHTS = (0.0, 1.0)  # every w > 0 gives the same order (GreedyDual): w = 0 is the ablation
ALPHAS = (0.0, 0.5, 1.0)  # alpha 2 and 4 were far worse on seed 0 (p99 170 s, 197 s)
KEEP_DEVICE = "histate_keep_device"  # ablation: HiState without releasing device snapshot copies
ISSUE_SCORE = "histate_issue_score"  # ablation: the issue's literal wall-clock score
ABLATIONS = (KEEP_DEVICE, ISSUE_SCORE)
FLOOR_SLACK = 1.1  # "within 10 % of the floor"


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
         "spills_dropped", "stores_skipped", "device_snapshots_released",
         "utilization")  # fmt: skip


def _shown(metrics: dict[str, Any]) -> dict[str, Any]:
    out = dict(metrics)
    for key in ("host_kv_read", "host_snapshot_read", "ssd_snapshot_read", "ssd_write"):
        out[f"{key}_GB"] = out.pop(f"{key}_bytes") / GB
    return {k: out[k] for k in SHOWN}


def make_traces(trace_dir: Path, quick: bool, seeds=SEEDS) -> dict[tuple[str, float, int], Path]:
    """Generate every (trace, rate, seed) once and save it; the paths."""
    paths = {}
    for name, (gen, kwargs, rates) in TRACES.items():
        kwargs = dict(kwargs)
        if quick:
            kwargs["n_sessions"] //= 6
        for rate in rates:
            for seed in seeds:
                path = trace_dir / f"{name}_rate{rate:g}_seed{seed}.jsonl"
                trace = gen(seed=seed, session_rate=rate, **kwargs)
                paths[(name, rate, seed)] = save_trace(trace, path)
    return paths


def variant_setup(variant: str, knob: float) -> tuple[str, HiStateConfig, CostModel, type | None]:
    """The simulator variant, policy config, cost model and policy class of one variant."""
    if variant in ("histate", FLOOR, ISSUE_SCORE):  # the device-pool release is modelled
        cfg = HiStateConfig(time_weight=knob, release_device_snapshots=True)
    elif variant == KEEP_DEVICE:  # ablation: snapshots keep their device copies
        cfg = HiStateConfig(release_device_snapshots=False)
    else:
        cfg = HiStateConfig(marconi_alpha=knob)
    sim_variant = "lru" if variant in VLLM_CLASSES else variant
    if variant in (FLOOR, *ABLATIONS):
        sim_variant = "histate"
    policy_cls = VLLM_CLASSES.get(variant) or (IssueScorePolicy if variant == ISSUE_SCORE else None)
    cost = dataclasses.replace(COST, host_bytes=10**15) if variant == FLOOR else COST
    return sim_variant, cfg, cost, policy_cls


def variant_config(variant: str, knob: float) -> dict[str, Any]:
    """What :func:`variant_setup` gives, JSON-ready (every field of the resolved config)."""
    sim_variant, cfg, cost, policy_cls = variant_setup(variant, knob)
    base = COST.describe()
    cls = policy_cls or HiStatePolicy
    if policy_cls in VLLM_CLASSES.values():
        cls = policy_cls.vllm_cls
    return {
        "simulated_policy": sim_variant,
        "policy_class": f"{cls.__module__}.{cls.__name__}" if policy_cls else cls.__name__,
        "store_threshold": getattr(policy_cls, "store_threshold", 0),  # vLLM's admission filter
        "histate": dataclasses.asdict(cfg),
        # config.cost_model holds the shared model; a variant records only what it changes
        "cost_model_changes": {k: v for k, v in cost.describe().items() if base.get(k) != v},
    }


def _simulate(path: Path, variant: str, knob: float) -> tuple[dict[str, Any], float]:
    """One variant on one saved trace (in a worker process); its metrics and seconds."""
    start = time.perf_counter()
    sim_variant, cfg, cost, policy_cls = variant_setup(variant, knob)
    metrics = simulate(load_trace(path), cost, sim_variant, cfg, policy_cls)
    return metrics, time.perf_counter() - start


def _run_jobs(jobs, paths, results, seconds, workers: int, desc: str) -> None:
    """Run ``(trace, rate, seed, variant, knob)`` jobs, ``workers`` processes at a time."""
    with ProcessPoolExecutor(max_workers=workers) as pool:
        futures = {job: pool.submit(_simulate, paths[job[:3]], *job[3:]) for job in jobs}
        for job, future in tqdm(futures.items(), desc=desc):
            results[job], secs = future.result()
            seconds[f"{job[0]}@{job[1]:g}/seed{job[2]}/{job[3]}/{job[4]:g}"] = secs


def run(paths, workers: int = 3, ablate: bool = False):
    """Every main variant on every saved trace, then the ablations at the headline load.

    Returns:
        ``(results, seconds, sizes, head)``: metrics keyed by
        ``(trace, rate, seed, variant, knob)`` (knob = ``w`` for histate, ``alpha``
        for marconi, 1.0 otherwise), simulation seconds, requests per trace,
        the headline rate.
    """
    results: dict[tuple, dict] = {}
    seconds: dict[str, float] = {}
    seeds = sorted({k[2] for k in paths})
    jobs = [(*key, v, 1.0) for key in paths for v in MAIN]
    _run_jobs(jobs, paths, results, seconds, workers, "histate sim")
    head = headline_rate(results, sorted({k[1] for k in paths if k[0] == "agentic"}))
    ablations = [("agentic", head, seed, "marconi", a) for seed in seeds for a in ALPHAS if a != 1]
    if ablate:  # seed 0 only; left out of the published run for time (see the module doc)
        ablations += [("agentic", head, seeds[0], "histate", w) for w in WEIGHTS if w != 1.0]
        ablations += [("agentic", head, seeds[0], v, 1.0) for v in ABLATIONS]
    _run_jobs(ablations, paths, results, seconds, workers, "histate ablations")
    sizes = {f"{k[0]}@{k[1]:g}/seed{k[2]}": results[(*k, "native", 1.0)]["requests"] for k in paths}
    return results, seconds, sizes, head


def per_seed(results, trace: str, rate: float, variant: str, knob: float = 1.0) -> list[dict]:
    """The metrics of one variant on every seed, in seed order."""
    runs = {
        k[2]: m for k, m in results.items() if k[:2] == (trace, rate) and k[3:] == (variant, knob)
    }
    return [runs[seed] for seed in sorted(runs)]


def seed_median(results, trace, rate, variant, knob=1.0, metric=METRIC) -> float:
    return statistics.median(m[metric] for m in per_seed(results, trace, rate, variant, knob))


def best_baseline(results, rate: float, knobs=True) -> tuple[str, float]:
    """The baseline (and Marconi's alpha) with the lowest median p99 at ``rate`` (agentic)."""
    candidates = [(v, 1.0) for v in BASELINES]
    if knobs:
        candidates += sorted({(k[3], k[4]) for k in results if k[:2] == ("agentic", rate)
                              and k[3] == "marconi"})  # fmt: skip
    return min(candidates, key=lambda c: seed_median(results, "agentic", rate, *c))


def headline_rate(results, rates) -> float:
    """Highest agentic rate where the best baseline's median TTFT < 1 s (else the lowest)."""
    ok = [r for r in rates
          if seed_median(results, "agentic", r, *best_baseline(results, r, knobs=False),
                         metric="ttft_p50_s") < 1.0]  # fmt: skip
    return max(ok) if ok else min(rates)


def _label(variant: str, knob: float) -> str:
    if variant in ("marconi", "histate") and knob != 1.0:
        return f"{variant}({'w' if variant == 'histate' else 'alpha'}={knob:g})"
    return "marconi(alpha=1)" if variant == "marconi" else variant


def _median_shown(runs: list[dict]) -> dict[str, Any]:
    out = median_metrics([_shown(m) for m in runs])
    out[f"{METRIC}_per_seed"] = [m[METRIC] for m in runs]
    return out


def build_result(results, seconds, sizes, head, args) -> BenchResult:
    rates = {name: sorted({k[1] for k in results if k[0] == name}) for name in TRACES}
    seeds = sorted({k[2] for k in results})
    shown = [("agentic", head)]
    if rates.get("bfcl"):
        shown.append(("bfcl", rates["bfcl"][len(rates["bfcl"]) // 2]))
    variants: dict[str, dict] = {}
    configs: dict[str, dict] = {}
    for trace, rate in shown:
        for v, knob in sorted({k[3:] for k in results if k[:2] == (trace, rate)},
                              key=lambda c: (c[0] not in MAIN, c)):  # fmt: skip
            name = f"{trace}@{rate:g}:{_label(v, knob)}"
            variants[name] = _median_shown(per_seed(results, trace, rate, v, knob))
            configs[name] = variant_config(v, knob)
    series = {
        f"{trace}:{v}": [
            {"session_rate": r, **_median_shown(per_seed(results, trace, r, v))}
            for r in rates[trace]
        ]
        for trace in TRACES
        for v in MAIN
    }
    base_variant, alpha = best_baseline(results, head)
    ours = [m[METRIC] for m in per_seed(results, "agentic", head, "histate")]
    base = [m[METRIC] for m in per_seed(results, "agentic", head, base_variant, alpha)]
    floor = [m[METRIC] for m in per_seed(results, "agentic", head, FLOOR)]
    headline = headline_from_rounds(
        f"agentic@{head:g} {METRIC}", ours, base, _label(base_variant, alpha),
        higher_is_better=False, target=TARGET,
    )  # fmt: skip
    floor_med = statistics.median(floor)
    bound = {
        "floor": floor_med,
        "floor_per_seed": floor,
        "floor_over_baseline": floor_med / headline["baseline"],
        "ours_over_floor": headline["ours"] / floor_med,
    }
    bound["target_applied"] = verdict(headline, bound)
    return BenchResult(
        name=NAME,
        description=describe(results, rates, head, headline, bound, seeds),
        variants=variants,
        headline=headline,
        fingerprint=collect_fingerprint(),
        command=command_line("benchmarks.histate.sim", args.argv),
        variant_configs=configs,
        config={
            "cost_model": COST.describe(),
            "policy_config": dataclasses.asdict(HiStateConfig()),
            "traces": {k: {**v[1], "rates": v[2], "seeds": seeds} for k, v in TRACES.items()},
            "requests_per_trace": sizes,
            "weights": list(WEIGHTS),
            "alphas": list(ALPHAS),
            "quick": args.quick,
            "headline_rate": head,
            "no_eviction_floor": bound,
            "headline_rule": "highest agentic rate at which the best of vllm_lru, vllm_arc "
            "(store_threshold 0 or 2) and marconi (alpha=1), by median p99 over seeds, has a "
            "median p50 TTFT < 1 s; baseline = the best of those and Marconi (any swept alpha) "
            "there",
            "sim_seconds": seconds,
        },
        series=series,
        sweep_axis="session_rate",
        plot_metric=METRIC,
    )


def verdict(headline: dict[str, Any], bound: dict[str, Any]) -> str:
    """Which target applies (3x, or 10 % of the floor) and whether it is met."""
    ratio, floor_ratio = headline["ratio"], bound["floor_over_baseline"]
    if floor_ratio <= 1 / 3:
        met = "met" if ratio <= 1 / 3 else "NOT met"
        return f"Target >= 3x (the floor is {1 / floor_ratio:.2f}x below the baseline): {met}"
    met = "met" if bound["ours_over_floor"] <= FLOOR_SLACK else "NOT met"
    return (
        f"The floor itself is only {1 / floor_ratio:.2f}x below the baseline (closer than 3x), "
        f"so the target is HiState within 10% of the floor: HiState is "
        f"{bound['ours_over_floor']:.3f}x the floor, {met}"
    )


def describe(results, rates, head, headline, bound, seeds) -> str:
    """Top of the markdown: what ran and an honest verdict on the target."""
    per_rate = []
    for trace in TRACES:
        for r in rates[trace]:
            ours = seed_median(results, trace, r, "histate")
            best = min(seed_median(results, trace, r, v) for v in BASELINES)
            floor = seed_median(results, trace, r, FLOOR)
            per_rate.append(f"{trace}@{r:g}: {best / ours:.2f}x (floor {best / floor:.2f}x)")
    at_head = {v: seed_median(results, "agentic", head, v) for v in MAIN}
    p50 = {v: seed_median(results, "agentic", head, v, metric="ttft_p50_s") for v in MAIN}
    saturated = [v for v in MAIN if p50[v] > 1.0]
    s0 = seeds[0]
    ablation = {
        k[3:]: m[METRIC]
        for k, m in results.items()
        if k[:3] == ("agentic", head, s0) and k[3] in (*ABLATIONS, "histate")
    }
    weights = ", ".join(f"w={k:g}: {v:.3g}s" for (name, k), v in sorted(ablation.items())
                        if name == "histate")  # fmt: skip
    alphas = ", ".join(
        f"alpha={a:g}: {seed_median(results, 'agentic', head, 'marconi', a):.3g}s"
        for a in sorted({k[4] for k in results if k[:2] == ("agentic", head) and k[3] == "marconi"})
    )
    spread = headline.get("ratio_spread") or [headline["ratio"]] * 2
    doc = __doc__.split(chr(10) + chr(10), 1)
    return (
        f"{doc[0]}\n\n{doc[1]}\n"
        f"**Verdict:** at the headline load (agentic, {head:g} sessions/s; median over seeds "
        f"{', '.join(map(str, seeds))}) HiState's p99 TTFT is {headline['ours']:.3g}s vs "
        f"{headline['baseline']:.3g}s for the best baseline ({headline['baseline_name']}): "
        f"{1 / headline['ratio']:.2f}x lower (per seed {1 / spread[1]:.2f}x to "
        f"{1 / spread[0]:.2f}x). The no-eviction floor is {bound['floor']:.3g}s. "
        f"{bound['target_applied']}. Median p99 by variant: "
        + ", ".join(f"{v} {t:.3g}s" for v, t in at_head.items())
        + f". Saturated at this load (median TTFT > 1 s: their queue grows through the trace, "
        f"so ratios against them measure overload): {', '.join(saturated) or 'none'}. Marconi "
        f"by alpha: {alphas}. "
        + (
            f"Seed {s0} ablations: HiState by time weight {weights}; without releasing device "
            f"snapshot copies {ablation[(KEEP_DEVICE, 1.0)]:.3g}s; the issue's literal "
            f"wall-clock score {ablation[(ISSUE_SCORE, 1.0)]:.3g}s. "
            if (KEEP_DEVICE, 1.0) in ablation
            else ""
        )
        + f"Best-baseline (alpha=1)-over-HiState median p99 at every swept load (and over the "
        f"floor): {', '.join(per_rate)}. All of it is simulated (cost-model assumptions, not "
        "H200 measurements)."
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1/6 of the sessions: a smoke run")
    parser.add_argument("--trace-dir", default="tmp/histate_traces")
    parser.add_argument("--seeds", default=",".join(map(str, SEEDS)), help="trace seeds")
    parser.add_argument("--workers", type=int, default=3, help="simulation processes")
    parser.add_argument(
        "--ablations", action="store_true", help="also HiState's w=0, keep-device, issue score"
    )
    parser.add_argument("--out", default=OUT_DIR)
    args = parser.parse_args(argv)
    args.argv = argv
    seeds = [int(s) for s in args.seeds.split(",") if s]
    paths = make_traces(Path(args.trace_dir), args.quick, seeds)
    results, seconds, sizes, head = run(paths, args.workers, args.ablations)
    result = build_result(results, seconds, sizes, head, args)
    write_result(result, args.out)
    sys.stdout.write(headline_text(result.headline, "histate"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
