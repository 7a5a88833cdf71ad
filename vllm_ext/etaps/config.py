"""ETAPS serving configuration: one frozen dataclass, ``load_config(EtapsConfig, "etaps", ...)``.

Users set it as ``--additional-config '{"etaps": {...}}'`` or ``VLLMEXT_ETAPS_<FIELD>``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm_ext.common.config import ConfigError, load_config, option

SYSTEM = "etaps"


@dataclass(frozen=True)
class EtapsConfig:
    """How vLLM runs ETAPS sparse checkpoints."""

    max_sparse_tokens: int = option(
        8,
        doc="tokens per linear call up to which the sparse kernel runs (decode); larger "
        "calls (prefill) rebuild the dense weight and use vLLM's dense GEMM",
    )
    min_kernel_sparsity: float = option(
        0.7,
        doc="checkpoints below this sparsity are densified when they load and run vLLM's "
        "dense GEMM (1536x576, 1 thread: the kernel ties dense near 70 %, 3x faster at 90 %)",
    )

    def __post_init__(self) -> None:
        if self.max_sparse_tokens < 0:
            raise ConfigError(
                f"EtapsConfig.max_sparse_tokens must be >= 0, got {self.max_sparse_tokens}"
            )
        if not 0.0 <= self.min_kernel_sparsity < 1.0:
            raise ConfigError(
                f"EtapsConfig.min_kernel_sparsity must be in [0, 1), got {self.min_kernel_sparsity}"
            )


def etaps_config(mapping: Mapping[str, Any] | None = None, environ=None) -> EtapsConfig:
    return load_config(EtapsConfig, SYSTEM, mapping, environ)
