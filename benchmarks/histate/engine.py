"""HiState vs vLLM-native / LRU / Marconi in a real vLLM engine (tiny hybrid, CPU).

Every policy serves the same saved traces, closed-loop, in its own fresh
in-process engine (``benchmarks.histate.serve_trace``, one subprocess each):
the tiny Qwen3-Next hybrid (Gated-DeltaNet + attention, bf16) with prefix
caching on (vLLM's align mode, 384-token hybrid blocks) and a deliberately
small device pool, so that sessions evict each other's prefixes as a busy
accelerator would:

- ``native``: vLLM alone (device prefix cache only). vLLM's own KV offloading
  (``OffloadingConnector``, ``--kv-offloading-size``, its ``lru``/``arc``
  policies) does not run on the CPU build ("CPU Offloading is currently only
  supported on CUDA-alike and XPU GPUs"), so it cannot be the baseline here;
  the simulator (``benchmarks.histate.sim``) runs vLLM's own ``lru``/``arc``
  policy classes instead, and HiState's ``lru`` below evicts in the same order
  as vLLM's ``LRUCachePolicy`` (tests/unit/test_histate_vllm_policies.py);
- ``lru``, ``marconi``, ``histate``: the same HiState connector with that
  policy over a host-memory tier (KV + snapshots, one eviction queue) and an
  SSD tier (snapshot files, fsync'd, in a temp folder on this machine's disk),
  the same tier sizes for every policy.

Traces (seed 0, saved as JSONL, replayable): aiperf's agentic-coding sessions
scaled to the CPU (token counts x0.02: a 640-token shared tool/system layer,
contexts up to ~4k tokens) and BFCL v4 multi-turn tool use (real tool
schemas), think/tool delays x``time_scale``. Scenarios: ``agentic12_host12M``
(the headline: 12 sessions at 0.2/s with a 12 MiB host tier, too small for the
working set, so eviction order and SSD spills decide the hits; the only
scenario of the full run, sized to fit ~40 min for 3 rounds on 2 cores),
``agentic`` (24 sessions at 0.2/s, a load vLLM-native cannot sustain with this
device pool, host tier large enough that LRU and HiState hit alike),
``agentic_host24M`` (the same with a 24 MiB host tier), ``bfcl``, and
``agentic_low`` (12 sessions at 0.08/s). Metrics: TTFT from the moment a turn
is due to its first token (p50/p90/p99), token hit rate, tokens HiState loaded, recomputed prompt
tokens, snapshots and bytes read per tier, and whether first-turn outputs
equal native's. Headline: HiState vs the best baseline (lowest median p99
TTFT of native, LRU and Marconi) on the first scenario run (the full run:
``agentic12_host12M``); target from the issue: >= 1.5x lower.

Every policy runs ``--repeats`` rounds (round-robin over scenarios and policies,
so machine drift hits all alike); each metric is the median over rounds and the
headline carries every round's value.

Run: ``python -m benchmarks.histate.engine --scenarios agentic12_host12M
--repeats 3`` (~40 min on 2 cores; every scenario: ~60 min per round;
``--quick``: a third of the sessions; ``--reuse`` rebuilds the result from saved
runs). Needs a quiet machine: other CPU load changes every timing. The
headline's exact arguments are in ``benchmarks/suite.py`` (``make bench-histate``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from dataclasses import dataclass
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
    median_metrics,
    percentile,
    scrub,
    write_result,
)
from vllm_ext.bench.provenance import resolve_system_config
from vllm_ext.histate.traces import agentic_trace, bfcl_trace, save_trace

NAME = "histate_engine"
METRIC = "ttft_p99_s"
TARGET = (
    "ratio <= 0.667 (>= 1.5x lower p99 TTFT than the best of vLLM-native, LRU and Marconi "
    "with the same tiers, on the real engine)"
)
BASELINES = ("native", "lru", "marconi")
HEADLINE = "agentic12_host12M"
POLICIES = ("native", "lru", "marconi", "histate")
MB = 1 << 20
# name: (generator, kwargs, sessions per second); block_size = sharing granularity only
TRACES = {
    "agentic": (agentic_trace, dict(n_sessions=24, scale=0.02, block_size=16), 0.2),
    # the headline's: half the sessions, so that 3 rounds of every policy fit ~40 min
    "agentic12": (agentic_trace, dict(n_sessions=12, scale=0.02, block_size=16), 0.2),
    # the same session model at a load vLLM-native sustains (fewer sessions, lower rate)
    "agentic_low": (agentic_trace, dict(n_sessions=12, scale=0.02, block_size=16), 0.08),
    "bfcl": (bfcl_trace, dict(n_sessions=24, scale=0.5, block_size=16), 0.4),
}
ENGINE = dict(time_scale=0.5, device_bytes=16 * MB, ssd_bytes=1024 * MB)
LOADER_NOTE = (
    "vLLM-native is driven by the same closed-loop replay as the other policies "
    "(benchmarks.histate.replay), not `vllm bench serve`: a session's next turn carries its "
    "previous outputs, every policy must get the same turns, and every request is recorded."
)


@dataclass(frozen=True)
class Scenario:
    """A trace served with a host tier of ``host_bytes``."""

    trace: str
    host_bytes: int = 64 * MB
    # native ignores HiState's tiers: take its run from this scenario (same trace)
    native_from: str | None = None


SCENARIOS = {
    # host memory too small for the working set: the policy decides the hits (headline)
    HEADLINE: Scenario("agentic12", host_bytes=12 * MB),
    "agentic": Scenario("agentic"),
    # host memory too small for the working set: evictions and SSD spills decide hits
    "agentic_host24M": Scenario("agentic", host_bytes=24 * MB, native_from="agentic"),
    "bfcl": Scenario("bfcl"),
    "agentic_low": Scenario("agentic_low"),
}


def make_traces(trace_dir: Path, names, quick: bool) -> dict[str, Path]:
    paths = {}
    for name in names:
        gen, kwargs, rate = TRACES[name]
        kwargs = dict(kwargs, n_sessions=kwargs["n_sessions"] // (3 if quick else 1))
        trace = gen(seed=0, session_rate=rate, **kwargs)
        paths[name] = save_trace(trace, trace_dir / f"engine_{name}_seed0.jsonl")
    return paths


def serve(policy: str, trace: Path, out: Path, host_bytes: int) -> dict[str, Any]:
    """Run one policy on one trace in a fresh process; its JSON result."""
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.histate.serve_trace",
        "--policy",
        policy,
        "--trace",
        str(trace),
        "--out",
        str(out),
    ]
    for key, value in {**ENGINE, "host_bytes": host_bytes}.items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    log = out.with_suffix(".log")
    with open(log, "w", encoding="utf-8") as fh:
        done = subprocess.run(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{policy} on {trace.name} failed (exit {done.returncode}); see {log}")
    return json.loads(out.read_text(encoding="utf-8"))


def run_all(
    names, paths, trace_dir: Path, reuse: bool, repeats: int = 1
) -> dict[tuple[str, str], list[dict]]:
    """Every policy in every scenario, ``repeats`` rounds; per (scenario, policy) the
    rounds' runs in order (a saved run is read back with ``reuse``)."""
    runs: dict[tuple[str, str], list[dict]] = {}
    jobs = [(r, n, p) for r in range(repeats) for n in names for p in POLICIES]
    for round_, name, policy in tqdm(jobs, desc="histate engine", unit="run"):
        scenario = SCENARIOS[name]
        source = name
        if policy == "native" and scenario.native_from is not None:
            source = scenario.native_from
        out = trace_dir / f"run_{source}_{policy}{f'_r{round_}' if round_ else ''}.json"
        done = runs.setdefault((name, policy), [])
        if len(runs.get((source, policy), [])) > round_:
            done.append(runs[(source, policy)][round_])
        elif reuse and out.exists():
            done.append(json.loads(out.read_text(encoding="utf-8")))
        else:
            host = SCENARIOS[source].host_bytes
            done.append(serve(policy, paths[scenario.trace], out, host))
    return runs


def _times(baseline: float, ours: float) -> str:
    """``ours`` against ``baseline`` in words, whichever way it goes."""
    if ours <= baseline:
        return f"{baseline / ours:.2f}x lower"
    return f"{ours / baseline:.2f}x higher"


def variant_config(name: str, policy: str) -> dict[str, Any]:
    """Engine arguments of one (scenario, policy) run and its resolved HiState config."""
    from benchmarks.histate.serve_trace import engine_kwargs

    scenario = SCENARIOS[name]
    source = scenario.native_from if policy == "native" and scenario.native_from else name
    host = SCENARIOS[source].host_bytes
    kwargs = engine_kwargs(
        policy, ENGINE["device_bytes"], host, ENGINE["ssd_bytes"], "<temp folder per run>"
    )
    extra = kwargs.get("additional_config", {}).get("histate")
    return {
        "engine_kwargs": scrub(kwargs),
        "time_scale": ENGINE["time_scale"],
        "systems": {"histate": resolve_system_config("histate", extra)} if extra else {},
    }


def metrics(run: dict[str, Any], native: dict[str, Any] | None) -> dict[str, Any]:
    """What the table shows for one (trace, policy) run."""
    recs = run["records"]
    c = run["counters"]
    ttft = [r["ttft_s"] for r in recs]
    prompt = sum(r["prompt_tokens"] for r in recs)
    cached = sum(r["cached_tokens"] for r in recs)
    # HiState's counter also counts a hit again when a preempted request reloads it
    tier_tokens = c.get("hit_tokens", 0.0)
    out = {
        "requests": len(recs),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p90_s": percentile(ttft, 90),
        "ttft_p99_s": percentile(ttft, 99),
        "ttft_mean_s": sum(ttft) / len(ttft),
        "token_hit_rate": cached / prompt,
        "tier_loaded_tokens": tier_tokens,
        "recomputed_tokens": prompt - cached,
        "snapshots_from_host": c.get("snapshots_loaded_host", 0.0),
        "snapshots_from_ssd": c.get("snapshots_loaded_ssd", 0.0),
        "host_read_MB": c.get("load_bytes_host", 0.0) / MB,
        "ssd_read_MB": c.get("load_bytes_ssd", 0.0) / MB,
        "ssd_write_MB": c.get("ssd_write_bytes", 0.0) / MB,
        "host_evictions": c.get("host_evictions", 0.0),
        "spills": c.get("spills", 0.0),
        "wall_s": run["wall_s"],
    }
    if native is not None:
        # first turns have the same prompt under every policy; later prompts carry the
        # session's earlier outputs, so one differing token (bf16 numerics depend on
        # batching and chunking) changes every later turn of that session
        ref = {r["id"]: r["output_sha"] for r in native["records"]}
        first = [r for r in recs if r["id"].endswith("/t0")]
        same = sum(ref.get(r["id"]) == r["output_sha"] for r in first)
        out["first_turns_equal_native"] = same / len(first)
    return out


def per_round_metrics(runs: dict[tuple[str, str], list[dict]]) -> dict[str, list[dict]]:
    """:func:`metrics` of every round of every (scenario, policy), against native's same round."""
    out = {}
    for (trace, policy), rounds in runs.items():
        natives = runs.get((trace, "native")) or [None] * len(rounds)
        out[f"{trace}:{policy}"] = [metrics(r, n) for r, n in zip(rounds, natives, strict=True)]
    return out


def build_result(runs: dict[tuple[str, str], list[dict]], sizes: dict, args) -> BenchResult:
    rounds = per_round_metrics(runs)
    variants = {name: median_metrics(r) for name, r in rounds.items()}
    head = HEADLINE if (HEADLINE, "histate") in runs else next(iter(runs))[0]
    base = best_baseline(variants, head)
    device_blocks = next(iter(runs.values()))[0]["device_blocks"]
    return BenchResult(
        name=NAME,
        description=describe(variants, head, device_blocks, base),
        variants=variants,
        headline=headline_from_rounds(
            f"{head} {METRIC}",
            [m[METRIC] for m in rounds[f"{head}:histate"]],
            [m[METRIC] for m in rounds[f"{head}:{base}"]],
            "vllm_native" if base == "native" else base,
            higher_is_better=False,
            target=TARGET,
        ),
        fingerprint=collect_fingerprint(),
        command=command_line("benchmarks.histate.engine", args.argv),
        variant_configs={f"{n}:{p}": variant_config(n, p) for n, p in runs},
        config={
            "engine": {
                **ENGINE,
                "model": "tiny-hybrid",
                "device_blocks": device_blocks,
                "max_num_batched_tokens": 1536,
                "max_model_len": 8192,
            },
            "scenarios": {k: dataclasses.asdict(SCENARIOS[k]) for k in sizes},
            "traces": {
                t: {**TRACES[t][1], "session_rate": TRACES[t][2], "seed": 0}
                for t in {SCENARIOS[k].trace for k in sizes}
            },
            "requests_per_trace": sizes,
            "quick": args.quick,
            "repeats": args.repeats,
        },
        plot_metric=METRIC,
    )


def best_baseline(variants: dict[str, dict], scenario: str) -> str:
    """The baseline policy with the lowest median p99 TTFT in ``scenario``."""
    ran = [p for p in BASELINES if f"{scenario}:{p}" in variants]
    return min(ran, key=lambda p: variants[f"{scenario}:{p}"][METRIC])


def _versus_lru(lru: dict, ours: dict) -> str:
    """Recomputed tokens of LRU and HiState, and whether HiState's score lost hits."""
    a, b = lru["recomputed_tokens"], ours["recomputed_tokens"]
    text = f"; recomputed tokens LRU {a:,}, HiState {b:,}"
    if b > 1.05 * a:
        text += f" (**HiState recomputed {b / a - 1:.0%} more than LRU**)"
    return text + "."


def describe(variants: dict[str, dict], head: str, device_blocks: int, base: str) -> str:
    """Top of the markdown: what ran and an honest verdict."""
    lines = [__doc__.split("\n\n")[0], "", __doc__.split("\n\n", 2)[1], "", LOADER_NOTE, ""]
    for trace in sorted({k.split(":")[0] for k in variants}):
        v = {p: variants.get(f"{trace}:{p}") for p in POLICIES}
        if not v["histate"] or not v["native"]:
            continue
        parts = [f"{p} {m[METRIC]:.2f}s" for p, m in v.items() if m]
        lines.append(
            f"- **{trace}** p99 TTFT: {', '.join(parts)}; HiState vs native "
            f"{v['native'][METRIC] / v['histate'][METRIC]:.2f}x lower"
            + (
                f", vs Marconi {v['marconi'][METRIC] / v['histate'][METRIC]:.2f}x"
                if v["marconi"]
                else ""
            )
            + f"; token hit rate native {v['native']['token_hit_rate']:.0%}, "
            f"HiState {v['histate']['token_hit_rate']:.0%}"
            + (_versus_lru(v["lru"], v["histate"]) if v["lru"] else ".")
        )
    ours, theirs = variants[f"{head}:histate"][METRIC], variants[f"{head}:{base}"][METRIC]
    met = "met" if ours <= theirs / 1.5 else "NOT met"
    lines += [
        "",
        f"**Verdict ({head}):** HiState p99 TTFT {ours:.2f}s vs {theirs:.2f}s for the best "
        f"baseline ({base}): {_times(theirs, ours)} (target >= 1.5x lower: {met}). Device "
        f"pool: {device_blocks} blocks of 384 tokens for every policy; HiState spends no "
        "device memory of its own.",
        "",
        "**Reading it.** Medians of the rounds on a 2-core CPU: TTFT percentiles of runs with "
        "the same hits differ by up to ~2x (compare LRU and HiState wherever their recomputed "
        "tokens are equal, i.e. their host tier never filled), so only large gaps and the "
        "token counts are evidence. The greedy outputs of this bf16 model depend on batch "
        "composition even without any cache (benchmarks/histate/batch_variance.py: the same "
        "12 prompts alone vs batched, 6 of 12 identical), so first turns differing from "
        "native's reflect batching, not restores; restore exactness is tested on isolated "
        "requests (tests/engine/test_histate_engine.py).",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1/3 of the sessions: a smoke run")
    parser.add_argument(
        "--scenarios", default=",".join(SCENARIOS), help="comma-separated scenario names"
    )
    parser.add_argument("--trace-dir", default="tmp/histate_traces")
    parser.add_argument("--out", default=OUT_DIR)
    parser.add_argument(
        "--reuse", action="store_true", help="rebuild the result from saved run files"
    )
    parser.add_argument(
        "--repeats", type=int, default=1, help="rounds over every scenario and policy (medians)"
    )
    args = parser.parse_args(argv)
    args.argv = argv
    names = [n for n in args.scenarios.split(",") if n]
    unknown = set(names) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenarios {sorted(unknown)}; choose from {list(SCENARIOS)}")
    trace_dir = Path(args.trace_dir)
    paths = make_traces(trace_dir, {SCENARIOS[n].trace for n in names}, args.quick)
    runs = run_all(names, paths, trace_dir, args.reuse, args.repeats)
    sizes = {n: len(runs[(n, "native")][0]["records"]) for n in names}
    result = build_result(runs, sizes, args)
    write_result(result, args.out)
    h = result.headline
    sys.stdout.write(headline_text(h, "histate"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
