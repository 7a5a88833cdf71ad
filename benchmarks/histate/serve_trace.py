"""One policy serving one saved trace in a real in-process vLLM engine (run as a subprocess).

``python -m benchmarks.histate.serve_trace --policy P --trace T --out J`` starts
the tiny Qwen3-Next hybrid on the CPU (prefix caching on, i.e. vLLM's align
mode, a deliberately small device pool), replays the trace closed-loop
(:mod:`benchmarks.histate.replay`) through ``LLMEngine.add_request`` /
``step`` and writes per-request records plus HiState's counters as JSON.
``P = native`` runs vLLM alone; ``lru`` / ``marconi`` / ``histate`` run the
same HiState connector with that policy. One process per policy keeps
engines from sharing memory or threads.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.histate.replay import ClosedLoopReplay, Turn
from vllm_ext.common.counters import CounterSpec
from vllm_ext.histate.traces import load_trace
from vllm_ext.launcher import SYSTEMS

POLICIES = ("native", "lru", "marconi", "histate")
MAX_MODEL_LEN = 8192  # tiny-hybrid's max_position_embeddings
CHUNK = 1536  # prefill chunk: a multiple of the 384-token hybrid block


def engine_kwargs(
    policy: str, device_bytes: int, host_bytes: int, ssd_bytes: int, directory: str
) -> dict[str, Any]:
    """The engine arguments: identical for every policy but the connector."""
    from vllm_ext.assets import model_path

    kwargs: dict[str, Any] = dict(
        model=str(model_path("tiny-hybrid")),
        enforce_eager=True,
        seed=0,
        enable_prefix_caching=True,
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=CHUNK,
        kv_cache_memory_bytes=device_bytes,
    )
    if policy != "native":
        kwargs["kv_transfer_config"] = {
            **SYSTEMS["histate"].kv_connector,  # what `vllm-ext serve --plugins histate` sets
            "kv_role": "kv_both",
        }
        kwargs["additional_config"] = {
            "histate": {
                "policy": policy,
                "host_bytes": host_bytes,
                "ssd_bytes": ssd_bytes,
                "directory": directory,
            }
        }
    return kwargs


def _warm_up(llm) -> None:
    """First-call costs (allocations, kernels) must not land on the trace's first request."""
    from vllm import SamplingParams

    prompt = [7 + (i * 131) % 20000 for i in range(800)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    llm.reset_prefix_cache()


def replay(engine, plan: ClosedLoopReplay) -> list[dict[str, Any]]:
    """Serve every turn as it falls due; one record per finished request."""
    from vllm import SamplingParams

    live: dict[str, Turn] = {}
    first_token: dict[str, float] = {}
    records = []
    t0 = time.perf_counter()
    while plan.pending() or live:
        now = time.perf_counter() - t0
        for turn in plan.pop_due(now):
            params = SamplingParams(temperature=0, max_tokens=turn.max_tokens, ignore_eos=True)
            engine.add_request(turn.request_id, {"prompt_token_ids": turn.prompt}, params)
            live[turn.request_id] = turn
        if not live:
            due = plan.next_due_s()
            if due is not None:
                time.sleep(min(max(due - now, 0.0), 0.1))
            continue
        outputs = engine.step()
        now = time.perf_counter() - t0
        for out in outputs:
            turn = live.get(out.request_id)
            if turn is None:
                continue
            ids = out.outputs[0].token_ids
            if ids and out.request_id not in first_token:
                first_token[out.request_id] = now
            if out.finished:
                del live[out.request_id]
                plan.finished(turn, ids, now)
                records.append(_record(turn, out, first_token.pop(out.request_id, now), now))
    return records


def _record(turn: Turn, out, first_s: float, end_s: float) -> dict[str, Any]:
    ids = list(out.outputs[0].token_ids)
    return {
        "id": turn.request_id,
        "due_s": turn.due_s,
        "ttft_s": first_s - turn.due_s,
        "latency_s": end_s - turn.due_s,
        "prompt_tokens": len(turn.prompt),
        "cached_tokens": max(int(out.num_cached_tokens or 0), 0),
        "output_tokens": len(ids),
        "output_sha": hashlib.sha1(json.dumps(ids).encode()).hexdigest()[:16],
    }


def _scheduler(llm):
    """The in-process engine's scheduler (VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    return llm.llm_engine.engine_core.engine_core.scheduler


def counters_of(llm) -> dict[str, float]:
    """HiState's counters (empty for the native policy)."""
    connector = _scheduler(llm).connector
    if connector is None:
        return {}
    connector.runtime.drain()
    return {spec.name: connector.counters.value(spec.name) for spec in connector.COUNTER_SPECS
            if isinstance(spec, CounterSpec)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policy", choices=POLICIES, required=True)
    parser.add_argument("--trace", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--time-scale", type=float, default=0.5)
    parser.add_argument("--device-bytes", type=int, default=16 << 20)
    parser.add_argument("--host-bytes", type=int, default=64 << 20)
    parser.add_argument("--ssd-bytes", type=int, default=1 << 30)
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM

    trace = load_trace(args.trace)
    with tempfile.TemporaryDirectory(prefix="histate-bench-") as directory:
        llm = LLM(
            **engine_kwargs(
                args.policy, args.device_bytes, args.host_bytes, args.ssd_bytes, directory
            )
        )
        _warm_up(llm)
        before = counters_of(llm)
        plan = ClosedLoopReplay(trace, args.time_scale, max_tokens_total=MAX_MODEL_LEN)
        start = time.perf_counter()
        records = replay(llm.llm_engine, plan)
        wall = time.perf_counter() - start
        after = counters_of(llm)
        blocks = _scheduler(llm).kv_cache_manager.block_pool
        result = {
            "policy": args.policy,
            "trace": trace.name,
            "wall_s": wall,
            "device_blocks": blocks.num_gpu_blocks,
            "skipped_turns": plan.skipped_turns,
            "counters": {k: v - before.get(k, 0.0) for k, v in after.items()},
            "records": records,
        }
        Path(args.out).write_text(json.dumps(result), encoding="utf-8")
        connector = _scheduler(llm).connector
        if connector is not None:  # the folder goes away with this block: nothing to persist
            connector.runtime.close(persist=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
