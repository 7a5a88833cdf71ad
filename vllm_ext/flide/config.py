"""Flide configuration: one frozen dataclass, ``load_config(FlideConfig, "flide", ...)``.

Users set it as ``--additional-config '{"flide": {...}}'``; every field is
public (Flide has no experimental keys) and can also be set as
``VLLMEXT_FLIDE_<FIELD>``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm_ext.common.config import ConfigError, load_config, option

SYSTEM = "flide"


@dataclass(frozen=True)
class FlideConfig:
    """Limits of packed classification."""

    max_packed_tokens: int | None = option(
        None,
        doc="tokens per packed pass (None: the engine's max_num_batched_tokens, never more); "
        "larger requests are split into several passes (a pass runs between engine steps and "
        "outside vLLM's memory profile, so this bounds the pause and the memory it takes)",
    )
    max_questions: int = option(4096, doc="questions per request (>= 1); more is a 400 error")
    max_labels: int = option(64, doc="labels per request (>= 2); more is a 400 error")

    def __post_init__(self) -> None:
        for name, low in (("max_packed_tokens", 1), ("max_questions", 1), ("max_labels", 2)):
            value = getattr(self, name)
            if value is not None and value < low:
                raise ConfigError(f"FlideConfig.{name} must be >= {low}, got {value}")


def flide_config(mapping: Mapping[str, Any] | None = None, environ=None) -> FlideConfig:
    return load_config(FlideConfig, SYSTEM, mapping, environ)
