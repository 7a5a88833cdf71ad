"""``make demo``: serve SmolLM2 with every landed system and drive a short ShareGPT workload.

Starts ``vllm-ext serve`` (so the launcher, the plugins and vLLM's server all
run for real), sends ShareGPT first turns through the OpenAI client with a
progress bar, then prints requests, TTFT/TPOT percentiles and every
``vllm_ext:`` counter from ``/metrics``. Systems that need settings get them
from assets (LEAP: the ``leap-smollm2`` calibrated weights).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path

from vllm_ext.launcher import SYSTEMS


def _emit(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def _fmt_ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"


def extension_counters(metrics_text: str) -> dict[str, float]:
    """``vllm_ext:*`` samples from a Prometheus text page, summed over labels.

    prometheus_client adds a ``<name>_created`` sample (a Unix timestamp) beside
    every counter; it is not a count, so it is left out.
    """
    totals: dict[str, float] = {}
    for match in re.finditer(
        r"^(vllm_ext:[a-z0-9_]+)(?:\{[^}]*\})? ([0-9.e+-]+)$", metrics_text, re.MULTILINE
    ):
        name = match.group(1)
        if not name.endswith("_created"):
            totals[name] = totals.get(name, 0.0) + float(match.group(2))
    return totals


def summary_lines(summary: dict, counters: dict[str, float], plugins: list[str]) -> list[str]:
    lines = [
        "",
        "vllm_ext demo summary",
        f"  systems enabled : {', '.join(plugins) or '(none landed yet)'}",
        f"  requests        : {summary['ok_count']} ok, {summary['error_count']} failed",
        f"  TTFT p50/p90/p99: {_fmt_ms(summary['ttft_p50_s'])} / {_fmt_ms(summary['ttft_p90_s'])}"
        f" / {_fmt_ms(summary['ttft_p99_s'])}",
        f"  TPOT p50/p99    : {_fmt_ms(summary['tpot_p50_s'])} / {_fmt_ms(summary['tpot_p99_s'])}",
        f"  output tokens   : {summary['output_tokens_total']} "
        f"({summary['output_throughput_tok_per_s']:.1f} tok/s)",
        "  per-system counters:",
    ]
    lines += [f"    {name} = {value:g}" for name, value in sorted(counters.items())] or [
        "    (none: no system is enabled)"
    ]
    return lines


def system_args(plugins: list[str]) -> list[str]:
    """``vllm serve`` arguments the demo's systems need beyond ``--plugins``.

    vLLM has one ``--additional-config``; each system reads its own key of it.
    """
    additional: dict[str, dict] = {}
    if "leap" in plugins:
        from vllm_ext.assets.leap_weights import weights_path

        # without weights LEAP predicts nothing and the schedule stays FCFS
        additional["leap"] = {"weights_path": str(weights_path())}
    return ["--additional-config", json.dumps(additional)] if additional else []


DEMO_ITEM = {
    "context": "Support ticket: my March invoice was charged twice and I want a refund.",
    "questions": ["\nQuestion: Is this about billing?\nAnswer:",
                  "\nQuestion: Is the customer asking for a refund?\nAnswer:",
                  "\nQuestion: Is this about a login problem?\nAnswer:"],
}  # fmt: skip


def flide_lines(server) -> list[str]:
    """Classify three questions about one ticket in one packed pass over HTTP."""
    import urllib.request

    body = json.dumps({"labels": [" yes", " no"], "items": [DEMO_ITEM]}).encode()
    req = urllib.request.Request(server.base_url + "/v1/flide/classify", data=body,
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=120) as resp:
        results = json.loads(resp.read())["results"]
    lines = ["", "Flide: one packed pass, " + DEMO_ITEM["context"]]
    for question, result in zip(DEMO_ITEM["questions"], results, strict=True):
        question = question.split("Question: ")[1].split("\n")[0]
        lines.append(f"  {question:<40} -> {result['label'].strip()} "
                     f"(p={result['probs'][result['label']]:.2f})")  # fmt: skip
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vllm-ext demo", description=__doc__)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--rate", type=float, default=2.0, help="arrivals per second")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument(
        "--plugins",
        default=",".join(sorted(SYSTEMS)),
        help="systems to enable (default: all landed)",
    )
    args = parser.parse_args(argv)

    from vllm_ext.assets import model_path
    from vllm_ext.bench.loadgen import run_trace_sync
    from vllm_ext.bench.stats import summarize
    from vllm_ext.bench.workloads import sharegpt_requests
    from vllm_ext.serving import CPU_SERVE_ARGS, VllmServer

    model = model_path("smollm2")
    requests = sharegpt_requests(args.requests, rate=args.rate, seed=0, max_tokens=args.max_tokens)
    plugins = [p for p in args.plugins.split(",") if p]
    # HiState needs a hybrid (GDN/Mamba) model: it gets its own step on the tiny hybrid
    dense = [p for p in plugins if p not in HYBRID_ONLY]
    serve_args = [*CPU_SERVE_ARGS, "--served-model-name", "smollm2", "--plugins", ",".join(dense)]
    serve_args += system_args(plugins)
    log = Path(tempfile.gettempdir()) / "vllm-ext-demo-serve.log"
    _emit(f"Starting vllm-ext serve (log: {log}) ...")
    with VllmServer(str(model), serve_args, launcher="vllm-ext", log_path=log) as server:
        records = run_trace_sync(server.base_url, "smollm2", requests, desc="demo requests")
        extra = flide_lines(server) if "flide" in plugins else []
        counters = extension_counters(server.get("/metrics"))
    summary = summarize(records)
    for line in summary_lines(summary, counters, dense) + extra:
        _emit(line)
    if "histate" in plugins:
        for line in histate_lines():
            _emit(line)
    return 0 if summary["error_count"] == 0 else 1


HYBRID_ONLY = ("histate",)


def histate_lines() -> list[str]:
    """Tiny Qwen3-Next hybrid with HiState: a long prompt, the device cache reset, again."""
    import random
    import urllib.request

    from vllm_ext.assets import model_path
    from vllm_ext.serving import CPU_SERVE_ARGS, VllmServer

    rng = random.Random(11)
    prompt = [rng.randrange(100, 30000) for _ in range(900)]
    env = {"VLLM_SERVER_DEV_MODE": "1"}  # POST /reset_prefix_cache
    histate = {"histate": {"directory": tempfile.mkdtemp(prefix="histate-demo-")}}
    # one-block chunks: see the HiState limits in the README (EngineCore mamba block size);
    # bf16 SSM state keeps the block at 384 tokens on AVX-512-BF16 CPUs too
    args = [*CPU_SERVE_ARGS, "--served-model-name", "tiny", "--plugins", "histate",
            "--max-num-batched-tokens", "384", "--mamba-ssm-cache-dtype", "bfloat16",
            "--additional-config", json.dumps(histate)]  # fmt: skip
    log = Path(tempfile.gettempdir()) / "vllm-ext-demo-histate.log"
    _emit(f"Starting vllm-ext serve --plugins histate on the tiny hybrid (log: {log}) ...")
    with VllmServer(str(model_path("tiny-hybrid")), args, launcher="vllm-ext", env=env,
                    log_path=log) as server:  # fmt: skip

        def complete() -> str:
            body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 8,
                               "temperature": 0}).encode()  # fmt: skip
            req = urllib.request.Request(server.base_url + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})  # fmt: skip
            with urllib.request.urlopen(req, timeout=300) as resp:
                return json.loads(resp.read())["choices"][0]["text"]

        first = complete()
        reset = urllib.request.Request(server.base_url + "/reset_prefix_cache", method="POST")
        urllib.request.urlopen(reset, timeout=60).close()
        second = complete()
        counters = extension_counters(server.get("/metrics"))
    lines = ["", "HiState: a 900-token prompt, vLLM's device prefix cache reset, the prompt again",
             f"  same answer both times: {first == second}"]  # fmt: skip
    lines += [f"    {name} = {value:g}" for name, value in sorted(counters.items())
              if name.startswith("vllm_ext:histate_") and value]  # fmt: skip
    return lines


if __name__ == "__main__":
    sys.exit(main())
