"""``vllm.general_plugins`` entry point of LEAP (name: ``leap``).

Registers names only — the ``LeapConnector`` (under its class name, which
MultiConnector needs to rebuild stats) and the ``leap`` load format — after
checking LEAP's vLLM seams (``vllm_ext.common.compat``) of each model runner
this vLLM ships (V1 up to 0.33, Model Runner V2 on every release): on a vLLM
that lacks one, one line names it and LEAP registers nothing. A ``vllm serve``
that enables LEAP on an engine whose rows its probe cannot map (prefill
context parallelism, microbatching) exits with one line
(:mod:`vllm_ext.leap.runner_gate`). Where the V1 runner exists it also applies
``patches/v1_runner_handle.py`` (the probe's runner handle; a no-op from 0.34).
Nothing changes until a user selects LEAP (``--load-format leap``,
``--scheduler-cls vllm_ext.leap.scheduler.make_scheduler``,
``--kv-transfer-config`` with the connector) or runs ``vllm-ext serve --plugins leap``.
"""

from __future__ import annotations

import sys

from vllm_ext.common import compat
from vllm_ext.common.log import get_logger
from vllm_ext.common.systems import validate_serve_argv
from vllm_ext.leap.runner_gate import refuse_serve

logger = get_logger(__name__)


def probe_seams_hold() -> bool:
    """LEAP's probe seams hold for every model runner this vLLM ships.

    The V1 runner's where vLLM still ships it (the CPU build runs it); Model
    Runner V2's on every release (CUDA 0.33 runs it by default, 0.34 only it).
    """
    v1 = not compat.has_v1_runner() or compat.require("leap", runner="v1")
    return v1 and compat.require("leap", runner="v2")


def register() -> None:
    # VLLM_PLUGINS may select this plugin without vllm_ext's own: check the config here too
    validate_serve_argv(sys.argv)
    refuse_serve(sys.argv)
    # a system the command selects whose vLLM seams fail: one line, exit 2
    compat.refuse_serve(sys.argv)
    if not compat.supported_vllm() or not probe_seams_hold():
        return
    compat.register_connector_once("LeapConnector", "vllm_ext.leap.connector", "LeapConnector")
    from vllm.model_executor import model_loader

    from vllm_ext.patches import v1_runner_handle

    v1_runner_handle.apply()
    # vLLM has no membership test; its registry dict is it (re-entrancy; see compat.SEAMS)
    if "leap" not in model_loader._LOAD_FORMAT_TO_MODEL_LOADER:
        from vllm_ext.leap.loader import LOAD_FORMAT, LeapModelLoader

        model_loader.register_model_loader(LOAD_FORMAT)(LeapModelLoader)
