"""Where LEAP reads its settings in a vLLM engine: ``--additional-config '{"leap": {...}}'``.

``additional_config`` reaches every vLLM process (scheduler, workers, loader)
and is part of the compile-cache key, so a cached graph traced without the
probe is never reused for a run with it. Env vars ``VLLMEXT_LEAP_<FIELD>``
fill in what the block leaves out.
"""

from __future__ import annotations

from typing import Any

from vllm_ext.common.systems import config_from_vllm
from vllm_ext.leap.config import SYSTEM, LeapConfig


def leap_config_from_vllm(vllm_config: Any) -> LeapConfig:
    """Build :class:`LeapConfig` from a ``VllmConfig`` (duck-typed: no vLLM import)."""
    return config_from_vllm(SYSTEM, vllm_config)
