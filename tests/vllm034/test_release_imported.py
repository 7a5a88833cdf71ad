"""The tier runs 0.34's code: the version imported, and the seams it removed are really gone."""

from __future__ import annotations

import importlib.util


def test_the_imported_vllm_is_0_34():
    import vllm

    assert vllm.__version__ == "0.34.0"
    assert ".vllm-releases" in vllm.__file__


def test_model_runner_v1_is_gone_and_v2_is_there():
    assert importlib.util.find_spec("vllm.v1.worker.gpu_model_runner") is None
    assert importlib.util.find_spec("vllm.v1.worker.gpu.model_runner") is not None
