"""The LEAP probe keeps firing when vLLM compiles the model (no ``enforce_eager``).

The loader installs the forward hook before ``torch.compile`` traces the model
(``vllm_ext.leap.loader``); a hook added afterwards would never fire. vLLM's
CPU default is one Dynamo trace + Inductor, as ``vllm serve`` without
``--enforce-eager`` runs it (~1 min to compile on 2 cores).
"""

from __future__ import annotations

import numpy as np

from tests.engine.leap_helpers import hf_hidden_state, leap_engine_kwargs
from tests.helpers import engine

MODEL = "tiny-llama"
PROMPTS = [list(range(100, 140)), list(range(200, 290))]


def test_probe_fires_in_a_compiled_model():
    from vllm import SamplingParams

    kwargs = leap_engine_kwargs({"layer": 0, "return_probe": True}, dtype="float32")
    kwargs["enforce_eager"] = False
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with engine(MODEL, **kwargs) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        probe = out.kv_transfer_params["leap"]["probe"]
        assert probe is not None, "no probe vector: the hook did not fire in the compiled graph"
        np.testing.assert_allclose(probe, hf_hidden_state(MODEL, prompt, 0), rtol=1e-4, atol=1e-4)
