"""Registers the ``etaps`` quantization method; called by the suite's general plugin.

A checkpoint whose ``config.json`` says ``quantization_config.quant_method:
"etaps"`` then loads in every vLLM process with no flag. Nothing else changes.
"""

from __future__ import annotations

from vllm_ext.common import compat


def register() -> None:
    if not compat.supported_vllm() or not compat.require("etaps"):
        return
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS

    # register_quantization_config raises on a second registration (re-entrancy)
    if "etaps" not in QUANTIZATION_METHODS:
        import vllm_ext.etaps.linear_method  # noqa: F401  (registers on import)
