"""Serving side of the LEAP benchmark: one server per variant and round, the same trace each.

Every variant, plain vLLM included, is driven by vllm_ext's load generator
(not ``vllm bench serve``) so that all of them get the very same requests,
arrival times and length hints, and every request's TTFT and latency are kept.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from vllm_ext.bench import GpuPowerSampler, run_trace_sync, serve_config, summarize
from vllm_ext.bench.loadgen import Request, poisson_arrivals
from vllm_ext.common.config import config_block
from vllm_ext.leap.config import LeapConfig
from vllm_ext.serving import CPU_SERVE_ARGS, VllmServer

METRIC = "mean_per_token_latency_s"
LOADER_NOTE = (
    "Every variant, plain vLLM (fcfs) included, is driven by vllm_ext's load generator, not "
    "`vllm bench serve`, so that all get the same requests, arrivals and hints and every "
    "request's timings are kept."
)
HINT = "leap_predicted_tokens"
MAX_NUM_SEQS = 4


def serve_args(spec: dict, dtype: str) -> tuple[str, list[str]]:
    """Launcher and ``serve`` arguments of one variant."""
    args = [*CPU_SERVE_ARGS, "--max-num-seqs", str(MAX_NUM_SEQS), "--served-model-name", "smollm2"]
    args += ["--dtype", dtype]
    if not spec.get("plugins"):
        return "vllm", args
    args += ["--plugins", "leap"]
    if spec.get("config"):
        # variants list LeapConfig fields; users write experimental ones nested
        leap = config_block(LeapConfig, spec["config"]["leap"])
        args += ["--additional-config", json.dumps({"leap": leap})]
    return "vllm-ext", args


def variant_configs(variants: dict[str, dict], dtype: str) -> dict[str, dict]:
    """What each variant ran with: launcher, serve arguments, resolved LeapConfig, hint source."""
    out = {}
    for name, spec in variants.items():
        launcher, args = serve_args(spec, dtype)
        hints = "client-side length hints" if spec.get("hints") is not None else None
        out[name] = serve_config(launcher, args, hints=hints)
    return out


def _requests(prompts, hints, rate, max_tokens, seed=1) -> list[Request]:
    arrivals = poisson_arrivals(len(prompts), rate, seed=seed)
    out = []
    for i, (prompt, t) in enumerate(zip(prompts, arrivals, strict=True)):
        extra = {"vllm_xargs": {HINT: float(hints[i])}} if hints is not None else {}
        out.append(
            Request(
                id=f"t{i}",
                messages=[{"role": "user", "content": prompt}],
                max_tokens=max_tokens,
                arrival_s=t,
                extra_body=extra,
            )
        )
    return out


def _leap_counters(server: VllmServer) -> dict[str, float]:
    from vllm_ext.demo import extension_counters

    return {k.split(":", 1)[1]: v for k, v in extension_counters(server.get("/metrics")).items()}


def serve_all(model, variants, prompts, rates, args, logs: Path) -> tuple[dict, dict, dict]:
    """Every variant on the same trace, ``args.repeats`` rounds; medians over the rounds.

    Rounds go round-robin over the variants (a fresh server each time, so no
    prefix cache or online state carries over), so a machine that slows down
    mid-run slows every variant alike. Each point keeps the metric of every
    round as ``<metric>_runs`` (round ``i`` of every variant ran in the same pass).
    """
    runs: dict[str, list[dict]] = {}
    rounds: dict[str, list[dict]] = {}
    power = {}
    for round_ in range(args.repeats):
        for name, spec in variants.items():
            log = logs / f"{name}-{round_}.log"
            launcher, serve = serve_args(spec, args.dtype)
            server = VllmServer(str(model), serve, launcher=launcher, log_path=log)
            with server, GpuPowerSampler() as sampler:
                points = []
                for rate in rates:
                    reqs = _requests(prompts, spec.get("hints"), rate, args.max_tokens)
                    records = run_trace_sync(
                        server.base_url, "smollm2", reqs, desc=f"{name} rate={rate:g} #{round_}"
                    )
                    point = {"request_rate": rate, **summarize(records)}
                    point["output_tokens_mean"] = float(np.mean([r.output_tokens for r in records]))
                    points.append(point)
                runs.setdefault(name, []).append(_leap_counters(server))
            rounds.setdefault(name, []).append(points)
            power[name] = sampler.summary()
    series = {
        name: [median_point(list(p)) for p in zip(*r, strict=True)] for name, r in rounds.items()
    }
    counters = {name: median_point(c) for name, c in runs.items()}
    return series, counters, power


def median_point(points: list[dict]) -> dict:
    """Per key, the median over rounds of numeric values (others from the first round);
    the headline metric's per-round values as ``<metric>_runs``."""
    out = {}
    for key, first in points[0].items():
        values = [p.get(key) for p in points]
        numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
        out[key] = float(np.median(values)) if numeric else first
    if METRIC in out:
        out[f"{METRIC}_runs"] = [p[METRIC] for p in points]
    return out
