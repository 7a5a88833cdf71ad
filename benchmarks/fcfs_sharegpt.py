"""Plain vLLM (FCFS) on ShareGPT, with and without vllm_ext installed-but-idle.

The baseline every scheduling benchmark builds on: SmolLM2-135M-Instruct
serving ShareGPT first turns (output lengths = ShareGPT's own answers, capped,
EOS ignored) over a sweep of Poisson request rates, the highest one queueing
behind ``--max-num-seqs``. Two variants on the same requests:

- ``vllm``: vLLM with vllm_ext's plugin excluded from ``VLLM_PLUGINS``;
- ``vllm+vllm_ext``: ``vllm-ext serve`` with no system enabled.

Headline: output throughput at the highest rate (a burst), ours / vLLM; the
target is no overhead (ratio >= 0.97) when no system is enabled. Mean per-token
latency is reported too, but at a burst it mostly measures the order in which
simultaneous requests happen to reach the server (short ones stuck behind long
ones), which varies from run to run: a poor overhead signal.

Each variant runs ``--repeats`` times in A B B A order; every reported number is
the median over repeats (2-core machines drift by several percent between runs),
the headline's with the range over repeats. Both variants, plain vLLM included,
are driven by vllm_ext's load generator rather than ``vllm bench serve``, so
both get the very same requests and arrival times and every request's TTFT and
latency are kept.

Run: ``python -m benchmarks.fcfs_sharegpt`` (~8 min on 2 cores); the headline's
exact arguments are in ``benchmarks/suite.py`` (``make bench-suite``).
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from importlib.metadata import entry_points
from pathlib import Path

from vllm_ext.assets import model_path
from vllm_ext.bench import (
    OUT_DIR,
    BenchResult,
    GpuPowerSampler,
    collect_fingerprint,
    command_line,
    headline_from_rounds,
    headline_text,
    median_metrics,
    run_trace_sync,
    serve_config,
    summarize,
    write_result,
)
from vllm_ext.bench.workloads import sharegpt_requests
from vllm_ext.serving import CPU_SERVE_ARGS, VllmServer

NAME = "fcfs_sharegpt"
HEADLINE_METRIC = "output_throughput_tok_per_s"
LOADER_NOTE = (
    "Plain vLLM is driven by vllm_ext's load generator, not `vllm bench serve`, so that both "
    "variants get the same requests and arrival times and every request's timings are kept."
)


def _variants() -> dict[str, dict]:
    others = [ep.name for ep in entry_points(group="vllm.general_plugins") if ep.name != "vllm_ext"]
    # VLLM_PLUGINS="" would mean "nothing"; naming the others keeps vLLM's own plugins
    return {
        "vllm": {"launcher": "vllm", "env": {"VLLM_PLUGINS": ",".join(others) or ","}},
        "vllm+vllm_ext": {"launcher": "vllm-ext", "env": {}},
    }


SERVE_ARGS = (*CPU_SERVE_ARGS, "--served-model-name", "smollm2")


def _serve(model: Path, variant: dict, log: Path) -> VllmServer:
    return VllmServer(
        str(model), SERVE_ARGS, launcher=variant["launcher"], env=variant["env"], log_path=log
    )


def _repeat_order(names: list[str], repeats: int) -> list[str]:
    """A B, B A, A B, ...: a drift in machine speed hits both variants alike."""
    return [n for r in range(repeats) for n in (names if r % 2 == 0 else names[::-1])]


def run(
    rates: list[float],
    n_requests: int,
    max_tokens: int,
    out_dir: str,
    repeats: int = 2,
    argv: list[str] | None = None,
) -> BenchResult:
    model = model_path("smollm2")
    runs: dict[str, dict[float, list[dict]]] = {}
    power: dict[str, dict] = {}
    logs = Path(tempfile.mkdtemp(prefix="bench-fcfs-"))
    variants = _variants()
    for i, name in enumerate(_repeat_order(list(variants), repeats)):
        log = logs / f"{name}-{i}.log"
        with _serve(model, variants[name], log) as server, GpuPowerSampler() as sampler:
            for rate in rates:
                requests = sharegpt_requests(
                    n_requests, rate=rate, seed=0, max_tokens=max_tokens, tokenizer=model
                )
                records = run_trace_sync(
                    server.base_url, "smollm2", requests, desc=f"{name} rate={rate:g}"
                )
                runs.setdefault(name, {}).setdefault(rate, []).append(summarize(records))
        power[f"{name}-{i}"] = sampler.summary()
    # per point: the median over repeats of each metric
    series = {
        name: [{"request_rate": rate, **median_metrics(points)} for rate, points in by_rate.items()]
        for name, by_rate in runs.items()
    }
    top = {name: points[-1] for name, points in series.items()}
    # per repeat at the highest rate, in repeat order (repeat i of both variants ran together)
    per_round = {name: [r[HEADLINE_METRIC] for r in by[rates[-1]]] for name, by in runs.items()}
    result = BenchResult(
        name=NAME,
        description=f"{__doc__.split(chr(10) * 2)[0]} {LOADER_NOTE}",
        variants=top,
        headline=headline_from_rounds(
            HEADLINE_METRIC,
            per_round["vllm+vllm_ext"],
            per_round["vllm"],
            "vllm",
            higher_is_better=True,
            target="ratio >= 0.97 (no overhead with no system enabled)",
        ),
        fingerprint=collect_fingerprint(),
        command=command_line("benchmarks.fcfs_sharegpt", argv),
        power=power,
        series=series,
        sweep_axis="request_rate",
        plot_metric="mean_per_token_latency_s",
        config={
            "model": "SmolLM2-135M-Instruct (bf16)",
            "requests_per_rate": n_requests,
            "max_tokens_cap": max_tokens,
            "rates": rates,
            "serve_args": list(CPU_SERVE_ARGS),
            "scheduling": "FCFS (vLLM default)",
            "repeats": repeats,
            "repeat_order": _repeat_order(list(variants), repeats),
        },
        variant_configs={
            name: serve_config(v["launcher"], SERVE_ARGS, v["env"]) for name, v in variants.items()
        },
    )
    write_result(result, out_dir)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="1,4,inf", help="Poisson rates, req/s ('inf' = burst)")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2, help="runs per variant, ABBA order")
    parser.add_argument("--out", default=OUT_DIR)
    args = parser.parse_args(argv)
    rates = sorted(float(r) for r in args.rates.split(","))
    result = run(rates, args.requests, args.max_tokens, args.out, args.repeats, argv)
    h = result.headline
    sys.stdout.write(headline_text(h, "ours"))
    return 0 if all(math.isfinite(p[HEADLINE_METRIC]) for p in result.variants.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
