"""``make demo``: every landed system on a real ``vllm-ext serve``, each step checked.

1. SmolLM2-135M (float32) with ``--plugins leap,flide`` and two decode slots
   serves a short ShareGPT workload (TTFT/TPOT percentiles).
2. LEAP: two long requests take both slots, then three short ones arrive; the
   short ones finish first (vLLM's FCFS would finish the long ones first).
3. Flide: a few-shot header and six restaurant reviews, classified in one packed
   pass; beside each answer the expected label and the same question asked
   alone (``prompt_logprobs`` of the same server): ``Flide == separate``.
4. HiState, on the tiny Qwen3-Next hybrid: a 900-token prompt, vLLM's device
   prefix cache reset, the prompt again: the same answer, 768 tokens restored.

Each step prints what it expected beside what it got; the exit status is 1 if
any check failed.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from vllm_ext.leap.runtime import HINT_KEY

# the systems with a demo step; ARK needs a prefill/decode pair and ACCT a trained checkpoint
DEMO_SYSTEMS = ("flide", "histate", "leap")
HYBRID_ONLY = ("histate",)
LONG_TOKENS = 96
SHORT_TOKENS = 8
# checked against SmolLM2-135M-Instruct in a real engine (float32 and bf16): every label
# right, p >= 0.8
REVIEWS_HEADER = (
    "Classify each restaurant review as positive or negative.\n\n"
    "Review: The pasta was wonderful and the waiter was kind.\nSentiment: positive\n\n"
    "Review: The soup was cold and the staff were rude.\nSentiment: negative\n\n"
)
REVIEWS = (
    ("The food was delicious and the staff were lovely.", " positive"),
    ("Terrible. The worst meal of my life.", " negative"),
    ("Best pizza I have ever had!", " positive"),
    ("We waited an hour and the steak was burnt.", " negative"),
    ("Lovely place, we will come back soon.", " positive"),
    ("The fish smelled bad and I felt sick.", " negative"),
)
LABELS = [" positive", " negative"]
# label log-probabilities of Flide and of each question alone, float32: the tolerance of
# tests/engine/test_flide_engine.py (measured here: <= 2e-5)
SAME_LOGPROB_TOL = 1e-3


def _emit(text: str = "") -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def _emit_all(lines) -> None:
    for line in lines:
        _emit(line)


def _fmt_ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"


def _post(base_url: str, path: str, body: dict) -> dict:
    req = urllib.request.Request(base_url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=600) as resp:
        return json.loads(resp.read())


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


class Checks:
    """Expected-vs-got lines; remembers whether every one held."""

    def __init__(self) -> None:
        self.failed: list[str] = []
        self.count = 0

    def line(self, what: str, ok: bool, detail: str = "") -> str:
        self.count += 1
        if not ok:
            self.failed.append(" ".join(what.split()))
        return f"  [{'ok' if ok else 'WRONG'}] {what}{': ' + detail if detail else ''}"


def system_args(plugins: list[str]) -> list[str]:
    """``vllm serve`` arguments the demo's systems need beyond ``--plugins``."""
    additional: dict[str, dict] = {}
    if "leap" in plugins:
        from vllm_ext.assets import leap_weights_path

        # without weights LEAP predicts nothing and the schedule stays FCFS
        additional["leap"] = {"weights_path": str(leap_weights_path())}
    return ["--additional-config", json.dumps(additional)] if additional else []


def workload_lines(server, requests: int, rate: float, max_tokens: int, checks) -> list[str]:
    from vllm_ext.bench.loadgen import run_trace_sync
    from vllm_ext.bench.stats import summarize
    from vllm_ext.bench.workloads import sharegpt_requests

    trace = sharegpt_requests(requests, rate=rate, seed=0, max_tokens=max_tokens)
    s = summarize(run_trace_sync(server.base_url, "smollm2", trace, desc="demo requests"))
    return [
        f"\nShareGPT workload: {requests} requests at {rate:g}/s, up to {max_tokens} tokens each",
        checks.line(
            "every request answered",
            s["error_count"] == 0,
            f"{s['ok_count']} ok, {s['error_count']} failed",
        ),  # fmt: skip
        f"  TTFT p50/p90/p99: {_fmt_ms(s['ttft_p50_s'])} / {_fmt_ms(s['ttft_p90_s'])}"
        f" / {_fmt_ms(s['ttft_p99_s'])};  TPOT p50/p99: {_fmt_ms(s['tpot_p50_s'])}"
        f" / {_fmt_ms(s['tpot_p99_s'])};  {s['output_throughput_tok_per_s']:.1f} tok/s",
    ]


def leap_lines(server, checks) -> list[str]:
    """Two long requests hold both slots; three short ones arrive and finish first."""
    from openai import OpenAI

    client = OpenAI(base_url=server.base_url + "/v1", api_key="EMPTY")
    finished: list[str] = []
    lock = threading.Lock()
    started = [threading.Event(), threading.Event()]

    def long_request(i: int) -> None:
        stream = client.completions.create(
            model="smollm2", prompt=f"Tell me a long story about ship number {i}.", stream=True,
            max_tokens=LONG_TOKENS, temperature=0,
            extra_body={"min_tokens": LONG_TOKENS, "vllm_xargs": {HINT_KEY: LONG_TOKENS}},
        )  # fmt: skip
        for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                started[i].set()
        with lock:
            finished.append(f"long{i}")

    def short_request(i: int) -> None:
        client.completions.create(model="smollm2", prompt=f"Name colour number {i}:",
                                  max_tokens=SHORT_TOKENS, temperature=0)  # fmt: skip
        with lock:
            finished.append(f"short{i}")

    with ThreadPoolExecutor(5) as pool:
        jobs = [pool.submit(long_request, i) for i in range(2)]
        for event in started:
            event.wait(timeout=600)
        jobs += [pool.submit(short_request, i) for i in range(3)]
        for job in jobs:
            job.result(timeout=600)
    shorts_first = sorted(finished[:3]) == ["short0", "short1", "short2"]
    return [
        f"\nLEAP: 2 long requests ({LONG_TOKENS} tokens) take both decode slots, then 3 short"
        f" ones ({SHORT_TOKENS} tokens) arrive",
        f"  finishing order: {' '.join(finished)}   (FCFS would finish long0 and long1 first)",
        checks.line("the short requests overtook the long ones", shorts_first),
    ]


def _alone_logprob(server, prompt_ids: list[int], label_ids: list[int]) -> float:
    """Summed log-probability of ``label_ids`` after ``prompt_ids``, from the server alone."""
    body = {"model": "smollm2", "prompt": prompt_ids + label_ids, "max_tokens": 1,
            "prompt_logprobs": 0}  # fmt: skip
    steps = _post(server.base_url, "/v1/completions", body)["choices"][0]["prompt_logprobs"]
    return sum(steps[len(prompt_ids) + m][str(t)]["logprob"] for m, t in enumerate(label_ids))


def _tokens(server, text: str, special: bool) -> list[int]:
    body = {"model": "smollm2", "prompt": text, "add_special_tokens": special}
    return _post(server.base_url, "/tokenize", body)["tokens"]


def flide_lines(server, checks) -> list[str]:
    """Six reviews after one few-shot header, classified in one packed pass over HTTP."""
    questions = [f"Review: {text}\nSentiment:" for text, _ in REVIEWS]
    item = {"context": REVIEWS_HEADER, "questions": questions}
    reply = _post(server.base_url, "/v1/flide/classify", {"labels": LABELS, "items": [item]})
    context_ids = _tokens(server, REVIEWS_HEADER, special=True)
    label_ids = {label: _tokens(server, label, special=False) for label in LABELS}
    lines = [f"\nFlide: {len(REVIEWS)} reviews after a shared few-shot header, "
             f"{reply['usage']['passes']} packed pass(es)"]  # fmt: skip
    for (text, expected), question, result in zip(REVIEWS, questions, reply["results"],
                                                  strict=True):  # fmt: skip
        prompt_ids = context_ids + _tokens(server, question, special=False)
        alone = {lab: _alone_logprob(server, prompt_ids, ids) for lab, ids in label_ids.items()}
        alone_label = max(alone, key=alone.get)
        diff = max(abs(result["logprobs"][lab] - alone[lab]) for lab in LABELS)
        same = alone_label == result["label"] and diff <= SAME_LOGPROB_TOL
        got = result["label"].strip()
        lines.append(checks.line(
            f"{text:<52} expected {expected.strip():<8}", got == expected.strip() and same,
            f"Flide {got} (p={result['probs'][result['label']]:.2f}), alone {alone_label.strip()}"
            f"  {'Flide == separate' if same else 'Flide != separate'} (max |dlogp| {diff:.1e})",
        ))  # fmt: skip
    return lines


def histate_lines(checks) -> list[str]:
    """Tiny Qwen3-Next hybrid with HiState: a long prompt, the device cache reset, again."""
    import random

    from vllm_ext.assets import model_path
    from vllm_ext.serving import CPU_SERVE_ARGS, VllmServer

    rng = random.Random(11)
    prompt = [rng.randrange(100, 30000) for _ in range(900)]
    histate = {"histate": {"directory": tempfile.mkdtemp(prefix="histate-demo-"),
                           "host_bytes": 256 << 20}}  # fmt: skip
    # one-block chunks and bf16 SSM state: see "HiState" in README's troubleshooting
    args = [*CPU_SERVE_ARGS, "--served-model-name", "tiny", "--plugins", "histate",
            "--max-num-batched-tokens", "384", "--mamba-ssm-cache-dtype", "bfloat16",
            "--additional-config", json.dumps(histate)]  # fmt: skip
    log = Path(tempfile.gettempdir()) / "vllm-ext-demo-histate.log"
    _emit(f"\nStarting vllm-ext serve --plugins histate on the tiny hybrid (log: {log}) ...")
    env = {"VLLM_SERVER_DEV_MODE": "1"}  # POST /reset_prefix_cache
    with VllmServer(str(model_path("tiny-hybrid")), args, launcher="vllm-ext", env=env,
                    log_path=log) as server:  # fmt: skip
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0}
        first = _post(server.base_url, "/v1/completions", body)["choices"][0]["text"]
        reset = urllib.request.Request(server.base_url + "/reset_prefix_cache", method="POST")
        urllib.request.urlopen(reset, timeout=60).close()
        second = _post(server.base_url, "/v1/completions", body)["choices"][0]["text"]
        counters = _settled_counters(server, "vllm_ext:histate_hit_tokens_total")
    hit = counters.get("vllm_ext:histate_hit_tokens_total", 0.0)
    lines = ["HiState: a 900-token prompt, vLLM's device prefix cache reset, the prompt again",
             checks.line("same answer both times", first == second, f"{first!r} / {second!r}"),
             checks.line("restored from HiState: 768 tokens (two 384-token blocks)", hit == 768,
                         f"hit_tokens = {hit:g}")]  # fmt: skip
    lines += [f"    {name} = {value:g}" for name, value in sorted(counters.items())
              if name.startswith("vllm_ext:histate_") and value]  # fmt: skip
    return lines


def _settled_counters(server, name: str | None, timeout_s: float = 30.0) -> dict[str, float]:
    """Counters once ``name`` is non-zero: connector stats reach /metrics with a stats push."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        counters = extension_counters(server.get("/metrics"))
        if name is None or counters.get(name) or time.monotonic() > deadline:
            return counters
        time.sleep(0.5)


def _with_value(args, flag: str, value: str) -> list[str]:
    """``args`` with ``flag``'s value replaced."""
    args = list(args)
    args[args.index(flag) + 1] = value
    return args


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="vllm-ext demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--rate", type=float, default=2.0, help="arrivals per second")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--plugins", default=",".join(DEMO_SYSTEMS),
                        help="systems to enable (default: every one with a demo step)")  # fmt: skip
    args = parser.parse_args(argv)

    from vllm_ext.assets import model_path
    from vllm_ext.serving import CPU_SERVE_ARGS, VllmServer

    plugins = [p for p in args.plugins.split(",") if p]
    dense = [p for p in plugins if p not in HYBRID_ONLY]
    checks = Checks()
    # two decode slots: enough for the workload, and a queue for LEAP to reorder; float32,
    # so that Flide equals each question asked alone to rounding (bf16 differs by ~0.1)
    serve_args = [*_with_value(CPU_SERVE_ARGS, "--max-num-seqs", "2"), "--dtype", "float32",
                  "--served-model-name", "smollm2", "--plugins", ",".join(dense),
                  *system_args(plugins)]  # fmt: skip
    log = Path(tempfile.gettempdir()) / "vllm-ext-demo-serve.log"
    _emit(f"Starting vllm-ext serve SmolLM2-135M --plugins {','.join(dense)} (log: {log}) ...")
    with VllmServer(str(model_path("smollm2")), serve_args, launcher="vllm-ext",
                    log_path=log) as server:  # fmt: skip
        _emit_all(workload_lines(server, args.requests, args.rate, args.max_tokens, checks))
        if "leap" in plugins:
            _emit_all(leap_lines(server, checks))
        if "flide" in plugins:
            _emit_all(flide_lines(server, checks))
        counters = _settled_counters(
            server, "vllm_ext:leap_predictions_total" if "leap" in plugins else None
        )
    _emit("  counters on /metrics:")
    _emit_all(f"    {name} = {value:g}" for name, value in sorted(counters.items()) if value)
    if "histate" in plugins:
        _emit_all(histate_lines(checks))
    if checks.failed:
        _emit(f"\n{len(checks.failed)} of {checks.count} checks WRONG: {'; '.join(checks.failed)}")
        return 1
    _emit(f"\nAll {checks.count} checks right.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
