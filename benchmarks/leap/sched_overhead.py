"""LEAP's scheduler cost per engine step vs stock vLLM's, at GPU-scale batch and queue sizes.

The scheduler is the same Python on every platform, so this runs real in-process
engines (SmolLM2-135M-Instruct, float32, CPU) with many requests: ``--running``
decode slots (``max_num_seqs``) full and ``--waiting`` more queued, the same
requests for every variant, in round-robin rounds. Per step it times ``Scheduler.schedule`` and
``update_from_output`` (where LEAP orders queues, picks victims, takes probe
vectors, predicts, and runs RLS on finished requests), vLLM's own part inside
them (so LEAP's own time is measured apart from vLLM's noisy share) and the whole step. The
model's CPU step time is not the point: the scheduler milliseconds are compared
with a GPU step (``leap_gpu_probe``: 3-8 ms with CUDA graphs on an H200).

``PYTHONPATH=. python -m benchmarks.leap.sched_overhead [--running 256 --waiting 768]``
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import numpy as np
from tqdm import tqdm

from vllm_ext.assets import model_path
from vllm_ext.bench import (
    OUT_DIR,
    BenchResult,
    collect_fingerprint,
    command_line,
    headline_from_rounds,
    scrub,
    write_result,
)
from vllm_ext.bench.provenance import resolve_system_config

NAME = "leap_sched_overhead"
MODEL = "smollm2"


def variants(weights: str) -> dict[str, dict | None]:
    """Variant -> LEAP config (None: stock vLLM)."""
    leap = {"weights_path": weights, "max_wait_s": 600.0}
    return {
        "vllm_fcfs": None,
        "leap_no_weights": {"max_wait_s": 600.0},  # plugin on, nothing to order by
        "leap": leap,
        "leap_no_loops": {**leap, "loops": "off"},  # what reading outputs for loops costs
        "leap_rls_thread": {**leap, "rls_thread": True},
    }


def variant_configs(weights: str, args) -> dict[str, dict]:
    """Engine arguments and resolved LeapConfig of every variant."""
    out = {}
    for name, leap in variants(weights).items():
        systems = {} if leap is None else {"leap": resolve_system_config("leap", leap)}
        out[name] = {"engine_kwargs": scrub(_engine_kwargs(leap, args)), "systems": systems}
    return out


def _requests(args) -> list[tuple[list[int], int]]:
    rng = np.random.default_rng(0)
    n = args.running + args.waiting
    prompts = rng.integers(100, 30000, size=(n, args.prompt_tokens)).tolist()
    lengths = rng.integers(args.min_tokens, args.max_tokens + 1, size=n).tolist()
    return list(zip(prompts, lengths, strict=True))


def _engine_kwargs(leap: dict | None, args) -> dict:
    from vllm_ext.leap.calibrate import engine_kwargs

    common = dict(
        dtype="float32",
        max_num_seqs=args.running,
        max_num_batched_tokens=args.running * args.prompt_tokens,
        kv_cache_memory_bytes=args.kv_gib << 30,
        max_model_len=1024,
        enforce_eager=True,
        seed=0,
    )
    if leap is None:
        return common
    return {**engine_kwargs(leap), **common}


def _timed(obj, name: str, sink: list[float]) -> None:
    original = getattr(obj, name)

    def wrapper(*a, **kw):
        t0 = time.perf_counter()
        try:
            return original(*a, **kw)
        finally:
            sink.append((time.perf_counter() - t0) * 1e3)

    setattr(obj, name, wrapper)


def _timed_into_last(obj, name: str, sink: list[float]) -> None:
    """Add each call's milliseconds to ``sink[-1]`` (the caller appends one slot per step)."""
    original = getattr(obj, name)

    def wrapper(*a, **kw):
        t0 = time.perf_counter()
        try:
            return original(*a, **kw)
        finally:
            sink[-1] += (time.perf_counter() - t0) * 1e3

    setattr(obj, name, wrapper)


def _timed_vllm(sink: dict[str, list[float]]):
    """Time vLLM's own ``Scheduler`` methods (what LEAP's overrides call through ``super()``)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    originals = {name: getattr(Scheduler, name) for name in ("schedule", "update_from_output")}
    for name, original in originals.items():

        def wrapper(self, *a, _original=original, _sink=sink[name], **kw):
            t0 = time.perf_counter()
            try:
                return _original(self, *a, **kw)
            finally:
                _sink.append((time.perf_counter() - t0) * 1e3)

        setattr(Scheduler, name, wrapper)
    return lambda: [setattr(Scheduler, n, f) for n, f in originals.items()]


def measure(leap: dict | None, requests, args) -> dict:
    """Median per-step milliseconds of one variant over ``args.steps`` measured steps.

    ``leap_own_ms``: per step, the scheduler's time less vLLM's own ``Scheduler``
    methods inside it, plus LEAP's handling of finished requests that vLLM calls
    from its own ``update_from_output`` (the RLS updates): what LEAP's code adds
    (0 for stock vLLM), free of the run-to-run noise of vLLM's part.
    """
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    vllm_ms = {"schedule": [], "update_from_output": []}
    restore = _timed_vllm(vllm_ms)
    try:
        return _measure(leap, requests, args, vllm_ms)
    finally:
        restore()
        gc.collect()
        # the next variant's engine starts in this process: from a clean parallel state
        cleanup_dist_env_and_memory()


def _measure(leap, requests, args, vllm_ms: dict[str, list[float]]) -> dict:
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(model_path(MODEL)), **_engine_kwargs(leap, args))
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    sched_ms: list[float] = []
    update_ms: list[float] = []
    _timed(scheduler, "schedule", sched_ms)
    _timed(scheduler, "update_from_output", update_ms)
    # LEAP's RLS runs inside vLLM's update_from_output (vLLM frees a finished request
    # through the connector): counted as LEAP's own time, per step
    finish_ms: list[float] = []
    runtime = getattr(scheduler, "leap", None)  # LEAP's runtime, on its schedulers
    if runtime is not None:
        _timed_into_last(runtime, "on_finished", finish_ms)
    for i, (prompt, n) in enumerate(requests):
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
    step_ms, finished = [], 0
    for step in tqdm(range(args.warmup + args.steps), desc="steps", leave=False):
        finish_ms.append(0.0)
        t0 = time.perf_counter()
        finished += sum(o.finished for o in engine.step())
        if step >= args.warmup:
            step_ms.append((time.perf_counter() - t0) * 1e3)
    if runtime is not None:
        runtime.drain()
    measured = slice(args.warmup, None)
    # one vLLM call inside each of the scheduler's: the lists align by step
    own = np.add(sched_ms, update_ms) - np.add(vllm_ms["schedule"], vllm_ms["update_from_output"])
    if runtime is not None:
        own += np.asarray(finish_ms)
    row = {
        "schedule_ms": statistics.median(sched_ms[measured]),
        "update_ms": statistics.median(update_ms[measured]),
        "schedule_p90_ms": float(np.percentile(sched_ms[measured], 90)),
        "update_p90_ms": float(np.percentile(update_ms[measured], 90)),
        "step_ms": statistics.median(step_ms),
        "running": len(scheduler.running),
        "waiting": len(scheduler.waiting),
        "finished": finished,
        "leap_own_ms": float(np.median(own[measured])),
        "leap_own_p90_ms": float(np.percentile(own[measured], 90)),
    }
    row["scheduler_ms"] = row["schedule_ms"] + row["update_ms"]
    del llm, engine, scheduler, runtime
    return row


def _median_row(runs: list[dict]) -> dict:
    row = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    row["scheduler_ms_runs"] = [r["scheduler_ms"] for r in runs]
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--running", type=int, default=256, help="max_num_seqs")
    parser.add_argument("--waiting", type=int, default=768, help="requests queued beyond it")
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--min-tokens", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=3, help="steps not measured (prefill)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--kv-gib", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3, help="round-robin rounds (medians)")
    parser.add_argument(
        "--gpu-step-ms", type=float, default=4.3, help="GPU step to compare with (leap_gpu_probe)"
    )
    parser.add_argument("--out", default=OUT_DIR)
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    weights = str(model_path("leap-smollm2") / "weights.npz")
    requests = _requests(args)
    runs: dict[str, list[dict]] = {name: [] for name in variants(weights)}
    for _ in range(args.rounds):  # round-robin, so drift of the machine hits every variant
        for name, leap in variants(weights).items():
            runs[name].append(measure(leap, requests, args))
            sys.stderr.write(f"{name}: {runs[name][-1]}\n")
    rows = {name: _median_row(r) for name, r in runs.items()}
    base = rows["vllm_fcfs"]["scheduler_ms"]
    for row in rows.values():
        row["overhead_ms"] = row["scheduler_ms"] - base
        row["overhead_pct_of_gpu_step"] = 100 * row["overhead_ms"] / args.gpu_step_ms
        row["leap_own_pct_of_gpu_step"] = 100 * row["leap_own_ms"] / args.gpu_step_ms
    result = BenchResult(
        name=NAME,
        description=__doc__.split("\n\n")[0],
        variants=rows,
        headline=headline_from_rounds(
            "scheduler_ms",
            [r["scheduler_ms"] for r in runs["leap"]],
            [r["scheduler_ms"] for r in runs["vllm_fcfs"]],
            "vllm_fcfs",
            higher_is_better=False,
            target=f"LEAP's extra scheduler time < 1% of a {args.gpu_step_ms} ms GPU step",
        ),
        fingerprint=collect_fingerprint(),
        command=command_line("benchmarks.leap.sched_overhead", argv),
        variant_configs=variant_configs(weights, args),
        plot_metric="scheduler_ms",
        config={k: v for k, v in vars(args).items() if k != "out"} | {"model": MODEL},
    )
    write_result(result, args.out)
    sys.stdout.write(f"{result.headline}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
