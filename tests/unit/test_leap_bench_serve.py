"""LEAP's ``vllm bench serve`` benchmark: its command lines, parsing, checks and report.

No server runs here: the parsing is fed a result in the shape ``vllm bench
serve --save-result --save-detailed`` writes (vLLM 0.32's ``benchmarks/serve.py``).
"""

from __future__ import annotations

import json

import pytest

from benchmarks.leap.bench_serve import (
    BusyNeighbour,
    bench_command,
    build_result,
    dataset_rows,
    leap_accounting,
    parse_result,
    summarize_cell,
    variants,
)
from vllm_ext.bench import write_result


def _saved(latencies, output_lens, ttfts, throughput=50.0) -> dict:
    return {
        "duration": 10.0,
        "completed": len(latencies),
        "failed": 0,
        "total_output_tokens": sum(output_lens),
        "output_throughput": throughput,
        "mean_tpot_ms": 71.0,
        "output_lens": output_lens,
        "latencies": latencies,
        "ttfts": ttfts,
        "itls": [[] for _ in latencies],
    }


def test_per_token_latency_is_each_requests_latency_over_its_tokens_averaged():
    metrics = parse_result(_saved([4.0, 9.0, 2.0], [4, 3, 0], [1.0, 2.0, 2.0]))
    # (4/4 + 9/3) / 2; the request that wrote nothing (failed) is left out
    assert metrics["mean_per_token_latency_s"] == pytest.approx(2.0)
    assert metrics["output_tokens"] == 7 and metrics["mean_tpot_ms"] == 71.0
    assert metrics["p99_ttft_s"] == pytest.approx(1.0 + 0.99 * (2.0 - 1.0))
    with pytest.raises(ValueError, match="no request wrote"):
        parse_result(_saved([1.0], [0], [1.0]))


@pytest.mark.parametrize("arrivals, stopping", [("burst", "natural"), ("poisson", "fixed")])
def test_the_command_is_vllms_own_client_with_the_issues_flags(arrivals, stopping):
    cmd = bench_command(
        "http://127.0.0.1:8000", "/m", "/d.jsonl", 40, 256, arrivals, 2.0, stopping, "/r", "x.json"
    )
    assert cmd[cmd.index("bench") + 1] == "serve"
    text = " ".join(cmd)
    for flag in ("--backend openai", "--endpoint /v1/completions", "--dataset-name custom",
                 "--custom-output-len 256", "--temperature 0", "--save-detailed"):  # fmt: skip
        assert flag in text
    assert ("--request-rate inf" in text) == (arrivals == "burst")
    assert ("--request-rate 2 --burstiness 1.0" in text) == (arrivals == "poisson")
    assert ("--ignore-eos" in cmd) == (stopping == "fixed")
    with pytest.raises(ValueError, match="arrivals"):
        bench_command("u", "t", "d", 1, 1, "gamma", 1.0, "natural", "r", "f")


def test_dataset_rows_and_variants():
    rows = dataset_rows(["a", "b"], 256)
    assert [json.loads(json.dumps(r)) for r in rows] == [
        {"prompt": "a", "output_tokens": 256}, {"prompt": "b", "output_tokens": 256},
    ]  # fmt: skip
    specs = variants("/w.npz", 512)
    assert specs["fcfs"] == {}
    assert specs["leap_budget"]["config"]["leap"]["preempt_token_budget"] == 512


def test_leap_accounting_takes_leaps_counters_by_name():
    counters = {
        "vllm_ext:leap_sched_order_seconds_total": 1.5,
        "vllm_ext:leap_fcfs_fallback_steps_total": 3.0,
        "vllm_ext:histate_evictions_total": 9.0,
    }
    assert leap_accounting(counters) == {"sched_order_seconds": 1.5, "fcfs_fallback_steps": 3.0}


def _round(throughput, ttft, per_token):
    return {
        "output_throughput": throughput,
        "p99_ttft_s": ttft,
        "mean_per_token_latency_s": per_token,
    }


def test_checks_flag_a_cell_where_leap_loses_throughput_or_tail_ttft():
    runs = {
        "fcfs": [_round(100.0, 10.0, 6.0), _round(100.0, 10.0, 6.0)],
        "leap": [_round(96.0, 9.0, 3.0), _round(96.0, 9.0, 3.0)],
    }
    quiet = summarize_cell("quiet-burst-natural", runs)["leap"]
    assert quiet["throughput_ratio"] == pytest.approx(0.96) and not quiet["throughput_ok"]
    assert quiet["p99_ttft_ok"] and quiet["per_token_latency_ok"]
    assert quiet["output_throughput_spread"] == [96.0, 96.0]
    busy = summarize_cell("busy-poisson-fixed", runs)["leap"]
    assert "per_token_latency_ok" not in busy  # the 0.75x bar is the quiet burst's only


def test_the_report_headlines_the_worst_cell(tmp_path):
    throughput = {
        "quiet-burst-natural": {"fcfs": [66.0, 67.0, 65.0], "leap": [82.0, 81.0, 83.0]},
        "busy-burst-natural": {"fcfs": [52.0, 53.0, 51.0], "leap": [38.0, 39.0, 37.0]},
    }
    rows = {"quiet-burst-natural/leap": {"output_throughput": 82.0, "throughput_ok": True}}
    result = build_result(rows, throughput, {"rounds": 3}, {"host": "test"})
    assert "busy-burst-natural" in result.headline["metric"]
    assert result.headline["ratio"] == pytest.approx(38.0 / 52.0)
    paths = write_result(result, tmp_path, plot=False)
    assert json.loads(paths["json"].read_text())["headline"]["baseline_name"] == "fcfs"


def test_the_busy_neighbour_is_started_and_stopped_by_the_benchmark():
    with BusyNeighbour(max_s=30.0) as neighbour:
        assert neighbour.proc.poll() is None  # running
    assert neighbour.proc.poll() is not None  # stopped on exit, long before its bound
