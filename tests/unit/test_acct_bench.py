"""ACCT's benchmarks end to end on the tiny-llama asset (results are not checked, the shape is)."""

from __future__ import annotations

import json

from benchmarks.acct import quality, speed
from vllm_ext.acct import checkpoint as ckpt
from vllm_ext.acct.converter import Converters
from vllm_ext.acct.llama import LlamaShape
from vllm_ext.assets import model_path
from vllm_ext.bench import write_result


def test_speed_result(tmp_path):
    result = speed.run(model_path("tiny-llama"), None, [64, 128], 3, 1, 4, progress=lambda _: 0)
    assert result.name == "acct" and result.headline["target"] == 6.5
    assert set(result.variants) == {"own_prefill", "acct_import"}
    assert result.variants["acct_import"]["speedup_128"] > 0
    assert write_result(result, tmp_path, plot=False)["json"].is_file()


def test_quality_result_and_gate(tmp_path):
    folder = model_path("tiny-llama")
    shape = LlamaShape.from_config(json.loads((folder / "config.json").read_text()))
    ck = tmp_path / "zero"
    ckpt.save(ck, Converters(shape, 1), ckpt.CheckpointMeta(ckpt.target_identity(folder), 1, 4))
    result = quality.run(folder, {"zero": str(ck)}, 2, 64, 16, progress=lambda _: 0, needles=2)
    keep = result.config["equal_compute_tokens"]["zero"]
    assert keep == -(-(64 + 4) // 2)
    assert set(result.variants) == {"own", "acct:zero", f"truncated:{keep}", "no_context"}
    assert result.variants["own"]["top1"] == 1.0 and result.headline["baseline_name"] == "own"
    gate = quality.gate_of(result, "zero", 0.05, 0.97)
    assert gate["windows"] == 2 and isinstance(gate["passed"], bool)
    needles = result.config["needles"]
    assert len(needles) == 2 and all(set(n["answers"]) == set(result.variants) for n in needles)
    for item in needles:  # the needle sits inside the haystack, the question ends in its prefix
        assert 0 < item["depth"] < item["context"] == 64
    assert all(0 <= v["needle_exact_match"] <= 1 for v in result.variants.values())
    assert 0 <= result.variants[f"truncated:{keep}"]["needle_in_window"] <= 1
    assert write_result(result, tmp_path, plot=False)["md"].is_file()
