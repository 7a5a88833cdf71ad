"""`make demo`: what each step is given, what it expects, and how a wrong answer shows."""

from __future__ import annotations

import json

import pytest

from vllm_ext import demo
from vllm_ext.assets import leap_weights
from vllm_ext.launcher import SYSTEMS
from vllm_ext.leap import calibrate


def test_demo_enables_every_system_it_has_a_step_for_by_default(monkeypatch):
    seen = {}

    def stop_before_serving(plugins):
        # the demo asks for its systems' arguments just before it starts the server
        seen["plugins"] = plugins
        raise SystemExit(0)

    monkeypatch.setattr(demo, "system_args", stop_before_serving)
    monkeypatch.setattr("vllm_ext.assets.model_path", lambda name: f"/assets/{name}")
    with pytest.raises(SystemExit):
        demo.main([])
    assert seen["plugins"] == list(demo.DEMO_SYSTEMS)
    assert set(demo.DEMO_SYSTEMS) <= set(SYSTEMS)


def test_leap_gets_the_weights_asset_through_additional_config(monkeypatch):
    monkeypatch.setattr("vllm_ext.assets.leap_weights_path", lambda: "/a/leap-smollm2/weights.npz")
    args = demo.system_args(["leap"])
    assert args[0] == "--additional-config"
    assert json.loads(args[1]) == {"leap": {"weights_path": "/a/leap-smollm2/weights.npz"}}
    assert demo.system_args([]) == []


def test_every_calibration_setting_and_the_model_recipe_are_in_the_asset_recipe():
    # a change to any of them must rebuild the leap-smollm2 asset
    base = leap_weights.recipe("model-v1")
    assert leap_weights.recipe("model-v2") != base
    for i, (key, value) in enumerate(leap_weights.CALIBRATION):
        changed = list(leap_weights.CALIBRATION)
        changed[i] = (key, value + "0")
        original = leap_weights.CALIBRATION
        try:
            leap_weights.CALIBRATION = tuple(changed)
            assert leap_weights.recipe("model-v1") != base, key
        finally:
            leap_weights.CALIBRATION = original


def test_the_calibration_command_is_one_the_calibrate_cli_accepts(monkeypatch, tmp_path):
    seen = {}

    class Recorded(Exception):
        pass

    def fake_prompts(name, n, seed, offset=0):
        seen["prompts"] = (name, n, seed)
        return ["a prompt"]

    def fake_record(model, prompts, leap, max_tokens, temperature, dtype="auto"):
        seen["record"] = (model, max_tokens, temperature)
        raise Recorded

    monkeypatch.setattr(calibrate, "load_prompts", fake_prompts)
    monkeypatch.setattr(calibrate, "record", fake_record)
    argv = leap_weights.calibrate_argv(tmp_path / "model", tmp_path)
    assert argv[1:3] == ["-m", "vllm_ext.leap.calibrate"]
    with pytest.raises(Recorded):
        calibrate.main(argv[3:])
    settings = dict(leap_weights.CALIBRATION)
    assert seen["prompts"] == (settings["prompts"], int(settings["num-prompts"]),
                               int(settings["seed"]))  # fmt: skip
    assert seen["record"] == (str(tmp_path / "model"), int(settings["max-tokens"]), 0.0)


def test_the_flide_step_expects_both_classes_and_only_its_labels():
    expected = [label for _, label in demo.REVIEWS]
    # a classifier that always answered one label must get some reviews wrong
    assert set(expected) == set(demo.LABELS)
    assert len({text for text, _ in demo.REVIEWS}) == len(demo.REVIEWS)


def test_a_wrong_answer_is_reported_and_counted():
    checks = demo.Checks()
    assert checks.line("right", True, "x") == "  [ok] right: x"
    assert checks.line("wrong   thing", False) == "  [WRONG] wrong   thing"
    assert checks.count == 2 and checks.failed == ["wrong thing"]


def test_summary_counters_skip_prometheus_created_timestamps():
    page = (
        "# HELP vllm_ext:leap_predictions_total requests that received a length prediction\n"
        'vllm_ext:leap_predictions_total{engine="0",model_name="smollm2"} 4.0\n'
        'vllm_ext:leap_predictions_created{engine="0",model_name="smollm2"} 1.79622e+09\n'
        'vllm:request_success_total{engine="0"} 4.0\n'
    )
    assert demo.extension_counters(page) == {"vllm_ext:leap_predictions_total": 4.0}
