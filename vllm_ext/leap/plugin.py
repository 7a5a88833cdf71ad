"""``vllm.general_plugins`` entry point of LEAP (name: ``leap``).

Registers names only — the ``LeapConnector`` (under its class name, which
MultiConnector needs to rebuild stats) and the ``leap`` load format. Nothing
changes until a user selects them (``--load-format leap``, ``--scheduler-cls
vllm_ext.leap.scheduler.make_scheduler``, ``--kv-transfer-config`` with the
connector) or runs ``vllm-ext serve --plugins leap``.
"""

from __future__ import annotations

import sys

from vllm_ext.common.compat import register_connector_once, supported_vllm
from vllm_ext.common.systems import validate_serve_argv


def register() -> None:
    # VLLM_PLUGINS may select this plugin without vllm_ext's own: check the config here too
    validate_serve_argv(sys.argv)
    if not supported_vllm():
        return
    register_connector_once("LeapConnector", "vllm_ext.leap.connector", "LeapConnector")
    from vllm.model_executor import model_loader

    # NOTE: vLLM 0.32 has no membership test; its registry dict is it (re-entrancy)
    if "leap" not in model_loader._LOAD_FORMAT_TO_MODEL_LOADER:
        from vllm_ext.leap.loader import LOAD_FORMAT, LeapModelLoader

        model_loader.register_model_loader(LOAD_FORMAT)(LeapModelLoader)
