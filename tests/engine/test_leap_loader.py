"""``--load-format leap`` wraps the load format the user names (a real engine, CPU).

``dummy`` needs no files and gives random weights, so a probe that still
matches transformers' hidden state would mean the wrap fell back to ``auto``.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.engine.leap_helpers import hf_hidden_state, leap_engine_kwargs
from tests.helpers import engine
from vllm_ext.leap import loader

MODEL = "tiny-llama"
PROMPT = list(range(100, 140))


def _probe_and_loader(**kwargs):
    from vllm import SamplingParams

    leap = {"layer": 0, "return_probe": True}
    with engine(MODEL, **leap_engine_kwargs(leap, dtype="float32", **kwargs)) as llm:
        out = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=2))[0]
        probe = out.kv_transfer_params["leap"]["probe"]
    return np.asarray(probe), type(loader.LAST_INNER_LOADER).__name__


def test_leap_wraps_the_dummy_format_and_still_probes():
    probe, inner = _probe_and_loader(model_loader_extra_config={loader.INNER_FORMAT_KEY: "dummy"})
    assert inner == "DummyModelLoader"
    assert probe.shape == (hf_hidden_state(MODEL, PROMPT, 0).shape[0],)
    # random weights: the probe is not the checkpoint's hidden state
    assert not np.allclose(probe, hf_hidden_state(MODEL, PROMPT, 0), atol=1e-3)


def test_inner_format_cannot_be_leap_itself():
    from vllm.config.load import LoadConfig

    with pytest.raises(ValueError, match="cannot be 'leap'"):
        loader.inner_load_config(
            LoadConfig(
                load_format="leap", model_loader_extra_config={loader.INNER_FORMAT_KEY: "leap"}
            )
        )


def test_the_rest_of_the_extra_config_goes_to_the_inner_loader():
    from vllm.config.load import LoadConfig

    inner = loader.inner_load_config(
        LoadConfig(
            load_format="leap",
            model_loader_extra_config={loader.INNER_FORMAT_KEY: "tensorizer", "x": 1},
        )
    )
    assert (inner.load_format, inner.model_loader_extra_config) == ("tensorizer", {"x": 1})
