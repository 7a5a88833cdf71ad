"""Where LEAP reads its settings in a vLLM engine: ``--additional-config '{"leap": {...}}'``.

``additional_config`` reaches every vLLM process (scheduler, workers, loader)
and is part of the compile-cache key, so a cached graph traced without the
probe is never reused for a run with it. Env vars ``VLLM_EXT_LEAP_<FIELD>``
fill in what the dict leaves out.
"""

from __future__ import annotations

from typing import Any

from vllm_ext.common.config import load_config
from vllm_ext.leap.config import SYSTEM, LeapConfig

ADDITIONAL_CONFIG_KEY = "leap"


def leap_config_from_vllm(vllm_config: Any) -> LeapConfig:
    """Build :class:`LeapConfig` from a ``VllmConfig`` (duck-typed: no vLLM import)."""
    extra = getattr(vllm_config, "additional_config", None) or {}
    return load_config(LeapConfig, SYSTEM, extra.get(ADDITIONAL_CONFIG_KEY, {}))
