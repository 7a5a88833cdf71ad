"""``vllm.general_plugins`` entry point of LEAP (name: ``leap``).

Registers names only — the ``LeapConnector`` (under its class name, which
MultiConnector needs to rebuild stats) and the ``leap`` load format — after
checking LEAP's vLLM seams (``vllm_ext.common.compat``): on a vLLM that lacks
one, one line names it and LEAP registers nothing. On a vLLM without the V1 model
runner (0.34) a ``vllm serve`` that enables LEAP exits with one line unless the
user opted in to the experimental V2 path (:mod:`vllm_ext.leap.runner_gate`).
On the V1 model runner it also applies ``patches/v1_runner_handle.py`` (the
probe's runner handle).
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


def probe_runner() -> str | None:
    """The model runner LEAP's probe can use on this vLLM (``"v1"``/``"v2"``), else None.

    V1 where vLLM still ships it (the CPU build runs it); Model Runner V2 through
    the connector's ``start_load_kv`` layout otherwise (and on GPUs where V2 runs),
    which the loader lets run only with the experimental opt-in.
    """
    if compat.has_v1_runner() and compat.require("leap", runner="v1"):
        return "v1"
    if compat.require("leap", runner="v2"):
        return "v2"
    return None


def register() -> None:
    # VLLM_PLUGINS may select this plugin without vllm_ext's own: check the config here too
    validate_serve_argv(sys.argv)
    refuse_serve(sys.argv)
    # a system the command selects whose vLLM seams fail: one line, exit 2
    compat.refuse_serve(sys.argv)
    if not compat.supported_vllm() or probe_runner() is None:
        return
    compat.register_connector_once("LeapConnector", "vllm_ext.leap.connector", "LeapConnector")
    from vllm.model_executor import model_loader

    from vllm_ext.patches import v1_runner_handle

    v1_runner_handle.apply()
    # vLLM has no membership test; its registry dict is it (re-entrancy; see compat.SEAMS)
    if "leap" not in model_loader._LOAD_FORMAT_TO_MODEL_LOADER:
        from vllm_ext.leap.loader import LOAD_FORMAT, LeapModelLoader

        model_loader.register_model_loader(LOAD_FORMAT)(LeapModelLoader)
