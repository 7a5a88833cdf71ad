"""``vllm.general_plugins`` entry point of HiState (name: ``histate``).

Registers HiState's recompute-aware eviction policy with vLLM's
``CachePolicyFactory`` as ``"histate"`` (:mod:`vllm_ext.histate.cache_policy`),
so vLLM's own ``OffloadingConnector`` can use it
(``--kv-offloading-size ... --kv-transfer-config
'{"kv_connector_extra_config": {"eviction_policy": "histate"}}'``). Nothing
changes until a user names it; HiState's own connector needs no registration
(``vllm-ext serve --plugins histate`` names it by module path).
"""

from __future__ import annotations

import sys

from vllm_ext.common import compat
from vllm_ext.common.systems import validate_serve_argv


def register() -> None:
    validate_serve_argv(sys.argv)
    # a system the command selects whose vLLM seams fail: one line, exit 2
    compat.refuse_serve(sys.argv)
    if not compat.supported_vllm() or not compat.require("histate"):
        return
    from vllm_ext.histate.cache_policy import register as register_policy

    register_policy()
