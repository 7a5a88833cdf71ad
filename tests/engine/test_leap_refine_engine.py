"""LEAP's decode-time refinement inside a real vLLM engine (tiny Llama, CPU, in-process).

The decode probe is the probe layer's state at the decoding token (equal to
transformers' on prompt + output so far), and a refinement head re-predicts
the remaining length from it while the request decodes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np

from tests.engine.leap_helpers import (
    hf_hidden_state,
    leap_connector_of,
    leap_engine_kwargs,
    write_weights,
)
from tests.engine.test_leap_engine import MODEL, PROMPTS, _params
from tests.helpers import engine
from vllm_ext.assets import model_path
from vllm_ext.leap.predictor import LinearLengthModel


def test_decode_probes_equal_transformers_hidden_states_at_their_token():
    leap = {"layer": 0, "return_probe": True, "refine_every": 4}
    with engine(MODEL, **leap_engine_kwargs(leap, dtype="float32")) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], _params(10))
    for prompt, out in zip(PROMPTS[:2], outs, strict=False):
        probes = out.kv_transfer_params["leap"]["decode_probes"]
        tokens = list(out.outputs[0].token_ids)
        assert [int(g) for g, _ in probes] == [4, 8]
        for generated, vector in probes:
            # the state at output token `generated - 1`, the decoding input
            expected = hf_hidden_state(MODEL, prompt + tokens[:generated], 0)
            np.testing.assert_allclose(vector, expected, rtol=1e-4, atol=1e-4)


def test_refinement_runs_and_learns_in_the_engine_and_outputs_are_unchanged(tmp_path):
    # both heads predict 2 tokens (left): below the 12-token cap, so capped requests teach them
    weights = write_weights(tmp_path / "w.npz", 128, constant=2.0)
    refine = write_weights(tmp_path / "refine.npz", 130, constant=2.0)
    ckpt = tmp_path / "ckpt.npz"
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    base = {"weights_path": str(weights)}
    with engine(MODEL, **leap_engine_kwargs(base)) as llm:
        plain = [
            o.outputs[0].token_ids for o in llm.generate(prompts, _params(12, ignore_eos=False))
        ]
    del llm  # the next engine needs this one gone
    leap = {
        **base,
        "refine_weights_path": str(refine),
        "refine_every": 4,
        "checkpoint_path": str(ckpt),
        "checkpoint_every": 1,
    }
    with engine(MODEL, **leap_engine_kwargs(leap)) as llm:
        outs = llm.generate(prompts, _params(12, ignore_eos=False))
        connector = leap_connector_of(llm)
        assert connector.runtime.num_live() == 0
    assert [o.outputs[0].token_ids for o in outs] == plain
    # probes at 4 and 8 generated tokens of each 12-token request
    assert connector.counters.value("refinements") == 2 * len(PROMPTS)
    refined = connector.counters.value("refine_rls_updates")
    assert refined > 0 and connector.runtime.refine.n_updates == refined
    assert (tmp_path / "ckpt.npz.refine.npz").exists()


def test_calibrate_cli_fits_a_refinement_head_for_the_serving_model(tmp_path):
    out = tmp_path / "w.npz"
    cmd = [sys.executable, "-m", "vllm_ext.leap.calibrate", "--model", str(model_path("smollm2"))]
    cmd += ["--out", str(out), "--num-prompts", "12", "--max-tokens", "24", "--refine-every", "8"]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    subprocess.run(cmd, check=True, env=env, timeout=600, capture_output=True)
    report = json.loads(out.with_suffix(".json").read_text())["refine"]
    assert report["weights"] == str(tmp_path / "w.refine.npz") and report["decode_probes"] >= 2
    hidden = LinearLengthModel.load(out).dim
    LinearLengthModel.load(report["weights"], dim=hidden + 2)  # what the runtime loads
