"""``vllm.general_plugins`` entry point of the shared plumbing (name: ``vllm_ext``).

vLLM calls it in every process (API server, EngineCore, workers). It is
re-entrant, cheap and registers names only; each system has its own entry
point, listed in ``pyproject.toml``, so ``VLLM_PLUGINS`` can select systems.
"""

from __future__ import annotations

import sys

from vllm_ext import __version__
from vllm_ext.common import compat
from vllm_ext.common.compat import installed_vllm_version, supported_vllm
from vllm_ext.common.log import get_logger
from vllm_ext.common.systems import validate_serve_argv
from vllm_ext.leap import runner_gate as leap_runner_gate

logger = get_logger(__name__)


def register() -> None:
    """Check a ``vllm serve`` config and the vLLM version once per process.

    Systems register only after this passes. vLLM loads general plugins before
    it parses its arguments, so a bad ``--additional-config`` stops ``vllm
    serve`` here, with one line, before any model or engine work.
    """
    validate_serve_argv(sys.argv)
    # LEAP's model-runner gate names the specific reason first (vLLM 0.34 has no V1 runner)
    leap_runner_gate.refuse_serve(sys.argv)
    # a system the command selects whose vLLM seams fail: one line, exit 2
    compat.refuse_serve(sys.argv)
    if supported_vllm():
        logger.debug("vllm_ext %s loaded on vLLM %s", __version__, installed_vllm_version())
        # ETAPS has no entry point of its own: its sparse checkpoints load with the suite
        from vllm_ext.etaps import plugin as etaps_plugin

        etaps_plugin.register()
