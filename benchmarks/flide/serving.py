"""Chat TTFT on a server that also runs Flide calls: does a packed pass starve serving?

One ``vllm-ext serve --plugins flide`` server per ``--max-num-batched-tokens``
(the tiny Qwen3-Next hybrid, bf16, CPU). Each server is measured twice on the
same chat requests (streaming, one every ``--interval`` s, 8 tokens):

- ``idle``: chat alone;
- ``flide``: chat while a client keeps posting Flide calls (one context of
  ``--context`` tokens with ``--questions`` questions, back to back).

A packed pass is capped at ``max_num_batched_tokens`` (8192 reproduces the
uncapped default ``max_packed_tokens``; 2048 is the capped pass). Reports
chat TTFT median / p90 / max and Flide calls and passes completed. Timings on
a shared CPU are noisy. Writes ``benchmarks/out/flide_serving.json``.

Run: ``python -m benchmarks.flide.serving`` (~5 min on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path

from vllm_ext.assets import model_path
from vllm_ext.serving import VllmServer

MODEL = "tiny-hybrid"
BASE_ARGS = ["--enforce-eager", "--kv-cache-memory-bytes", str(512 << 20), "--max-model-len",
             "4096", "--dtype", "bfloat16", "--served-model-name", "tiny", "--plugins", "flide",
             "--no-enable-prefix-caching"]  # fmt: skip


def chat_ttfts(base_url: str, count: int, interval: float) -> list[float]:
    """Time to the first streamed byte of a chat reply, one request every ``interval`` s."""
    out = []
    for n in range(count):
        message = {"role": "user", "content": f"Say something about number {n}."}
        body = {"model": "tiny", "max_tokens": 8, "stream": True, "messages": [message]}
        req = urllib.request.Request(base_url + "/v1/chat/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})  # fmt: skip
        start = time.perf_counter()
        with urllib.request.urlopen(req, timeout=600) as resp:
            for line in resp:
                if line.startswith(b"data: ") and b'"content"' in line:
                    out.append(time.perf_counter() - start)
                    break
            resp.read()
        time.sleep(max(0.0, interval - (time.perf_counter() - start)))
    return out


def flide_load(base_url: str, item: dict, stop: threading.Event, stats: dict) -> None:
    data = json.dumps({"labels": [" yes", " no"], "items": [item]}).encode()
    while not stop.is_set():
        req = urllib.request.Request(base_url + "/v1/flide/classify", data=data,
                                     headers={"Content-Type": "application/json"})  # fmt: skip
        start = time.perf_counter()
        with urllib.request.urlopen(req, timeout=600) as resp:
            usage = json.loads(resp.read())["usage"]
        stats["calls"] += 1
        stats["passes"] += usage["passes"]
        stats["seconds"].append(time.perf_counter() - start)


def summary(ttfts: list[float]) -> dict:
    ranked = sorted(ttfts)
    return {"n": len(ranked), "median_s": statistics.median(ranked),
            "p90_s": ranked[int(0.9 * (len(ranked) - 1))], "max_s": ranked[-1]}  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[8192, 2048],
                        help="max_num_batched_tokens per server")  # fmt: skip
    parser.add_argument("--chats", type=int, default=20)
    parser.add_argument("--interval", type=float, default=0.5)
    parser.add_argument("--context", type=int, default=1500, help="context words")
    parser.add_argument("--questions", type=int, default=64)
    parser.add_argument("--out", default="benchmarks/out/flide_serving.json")
    args = parser.parse_args(argv)
    item = {"context": "The river runs past the old mill and the bridge. " * (args.context // 10),
            "questions": [f"Question {n}: is the mill older than the bridge?"
                          for n in range(args.questions)]}  # fmt: skip
    results = {}
    for step in args.steps:
        server_args = [*BASE_ARGS, "--max-num-batched-tokens", str(step)]
        log = Path(f"benchmarks/out/flide_serving_{step}.log")
        log.parent.mkdir(parents=True, exist_ok=True)
        with VllmServer(str(model_path(MODEL)), server_args, launcher="vllm-ext",
                        log_path=log) as server:  # fmt: skip
            chat_ttfts(server.base_url, 2, 0.0)  # warm-up
            idle = chat_ttfts(server.base_url, args.chats, args.interval)
            stop, stats = threading.Event(), {"calls": 0, "passes": 0, "seconds": []}
            load = threading.Thread(target=flide_load, args=(server.base_url, item, stop, stats))
            load.start()
            time.sleep(1.0)
            busy = chat_ttfts(server.base_url, args.chats, args.interval)
            stop.set()
            load.join()
        calls = {"flide_calls": stats["calls"], "flide_passes": stats["passes"],
                 "flide_call_median_s": statistics.median(stats["seconds"])}  # fmt: skip
        results[str(step)] = {"idle": summary(idle), "flide": summary(busy), **calls}
        print(step, results[str(step)], flush=True)
    out = Path(args.out)
    out.write_text(json.dumps({"description": __doc__.split("\n\n")[0], "args": vars(args),
                               "results": results}, indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
