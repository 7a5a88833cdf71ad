"""`make demo` passes each enabled system what it needs (LEAP: the calibrated weights asset)."""

from __future__ import annotations

import json

from vllm_ext import demo
from vllm_ext.assets import leap_weights
from vllm_ext.launcher import SYSTEMS


def test_demo_enables_every_landed_system_by_default(monkeypatch):
    seen = {}

    def stop_before_serving(plugins):
        # the demo asks for its systems' arguments just before it starts the server
        seen["plugins"] = plugins
        raise SystemExit(0)

    monkeypatch.setattr(demo, "system_args", stop_before_serving)
    monkeypatch.setattr("vllm_ext.assets.model_path", lambda name: f"/assets/{name}")
    monkeypatch.setattr("vllm_ext.bench.workloads.sharegpt_requests", lambda *a, **k: [])
    try:
        demo.main([])
    except SystemExit:
        pass
    assert seen["plugins"] == sorted(SYSTEMS)


def test_leap_gets_the_weights_asset_through_additional_config(monkeypatch):
    monkeypatch.setattr(leap_weights, "weights_path", lambda: "/assets/leap-smollm2/weights.npz")
    args = demo.system_args(["leap"])
    assert args[0] == "--additional-config"
    assert json.loads(args[1]) == {"leap": {"weights_path": "/assets/leap-smollm2/weights.npz"}}
    assert demo.system_args([]) == []


def test_leap_asset_recipe_is_deterministic_and_names_the_model_recipe(tmp_path):
    recipe = leap_weights.recipe("smollm2-q4_1-bf16-v1")
    assert recipe == leap_weights.recipe("smollm2-q4_1-bf16-v1")
    assert "smollm2-q4_1-bf16-v1" in recipe and "num-prompts=96" in recipe
    argv = leap_weights.calibrate_argv(tmp_path / "model", tmp_path)
    assert argv[1:3] == ["-m", "vllm_ext.leap.calibrate"]
    assert argv[argv.index("--out") + 1] == str(tmp_path / "weights.npz")
    assert argv[argv.index("--max-tokens") + 1] == "128"
    assert argv[argv.index("--seed") + 1] == "0"


def test_summary_counters_skip_prometheus_created_timestamps():
    page = (
        "# HELP vllm_ext:leap_predictions_total requests that received a length prediction\n"
        'vllm_ext:leap_predictions_total{engine="0",model_name="smollm2"} 4.0\n'
        'vllm_ext:leap_predictions_created{engine="0",model_name="smollm2"} 1.79622e+09\n'
        'vllm:request_success_total{engine="0"} 4.0\n'
    )
    assert demo.extension_counters(page) == {"vllm_ext:leap_predictions_total": 4.0}
