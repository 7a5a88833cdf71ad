"""ACCT configuration: one frozen dataclass, read from ``--additional-config '{"acct": {...}}'``.

Every field can also be set as an environment variable (see
:func:`vllm_ext.common.config.env_var_name`). Values are checked in
``__post_init__`` so a directly constructed ``AcctConfig`` obeys the same rules.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm_ext.common.config import ConfigError, load_config, option

SYSTEM = "acct"


@dataclass(frozen=True)
class AcctConfig:
    """Settings of the ACCT import connector."""

    checkpoint: str | None = option(
        None,
        path="dir",
        not_paths=("identity",),
        doc="converter checkpoint folder from `python -m vllm_ext.acct train`, or 'identity' "
        "(the target's own KV: exact, as slow as a prefill; for plumbing checks); required",
    )
    min_prefix_tokens: int = option(
        256, doc="import only prefixes of at least this many tokens (>= 1); shorter ones prefill"
    )
    max_delta_nll: float = option(
        0.05,
        doc="offline gate: refuse a checkpoint whose held-out NLL exceeds own prefill's by "
        "more (nats/token, >= 0)",
    )
    min_top1: float = option(
        0.97,
        doc="offline gate: refuse a checkpoint whose top-1 agreement with own prefill is lower "
        "(in [0, 1])",
    )
    check_tokens: int = option(
        16,
        doc="online check: the target re-predicts this many last prefix tokens over the import "
        "(>= 0; 0 = off)",
    )
    check_max_gap: float = option(
        0.1,
        doc="online check: recompute when the import's NLL there exceeds that over the sink "
        "tokens alone by more (nats/token)",
    )

    def __post_init__(self) -> None:
        if self.min_prefix_tokens < 1:
            raise ConfigError(
                f"AcctConfig.min_prefix_tokens must be >= 1, got {self.min_prefix_tokens}"
            )
        if not (math.isfinite(self.max_delta_nll) and self.max_delta_nll >= 0):
            raise ConfigError(f"AcctConfig.max_delta_nll must be >= 0, got {self.max_delta_nll}")
        if not 0.0 <= self.min_top1 <= 1.0:
            raise ConfigError(f"AcctConfig.min_top1 must be in [0, 1], got {self.min_top1}")
        if self.check_tokens < 0:
            raise ConfigError(f"AcctConfig.check_tokens must be >= 0, got {self.check_tokens}")
        if math.isnan(self.check_max_gap):
            raise ConfigError("AcctConfig.check_max_gap must be a number, got nan")


def load_acct_config(
    mapping: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None
) -> AcctConfig:
    return load_config(AcctConfig, SYSTEM, mapping, environ)


def from_additional_config(additional_config: Mapping[str, Any] | None) -> AcctConfig:
    """The ``"acct"`` block of vLLM's ``additional_config`` (absent = defaults + env)."""
    block = (additional_config or {}).get(SYSTEM)
    if block is not None and not isinstance(block, Mapping):
        raise ConfigError(f'additional_config["{SYSTEM}"] must be an object, got {block!r}')
    return load_acct_config(block)
