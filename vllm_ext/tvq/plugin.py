"""``vllm.general_plugins`` entry point of TVQ (name: ``tvq``).

Registers the ``tvq`` quantization method in every vLLM process, so a
checkpoint whose ``config.json`` says ``quantization_config.quant_method:
"tvq"`` loads with no flag. Nothing else changes.
"""

from __future__ import annotations

import sys

from vllm_ext.common import compat
from vllm_ext.common.systems import validate_serve_argv


def register() -> None:
    validate_serve_argv(sys.argv)
    # a system the command selects whose vLLM seams fail: one line, exit 2
    compat.refuse_serve(sys.argv)
    if not compat.supported_vllm() or not compat.require("tvq"):
        return
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS

    # register_quantization_config raises on a second registration (re-entrancy)
    if "tvq" not in QUANTIZATION_METHODS:
        import vllm_ext.tvq.linear_method  # noqa: F401  (registers on import)
