"""TVQ configuration: one frozen dataclass, ``load_config(TvqConfig, "tvq", ...)``.

Serving reads the quantization format from the checkpoint's ``config.json``;
this block only chooses the kernel (``--additional-config '{"tvq": {...}}'`` or
``VLLMEXT_TVQ_<FIELD>``). The trainer's defaults live here too, as experimental keys.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm_ext.common.config import ConfigError, load_config, option

SYSTEM = "tvq"


@dataclass(frozen=True)
class TvqConfig:
    """Kernel choice of the ``tvq`` quantization method, and trainer defaults."""

    max_kernel_tokens: int = option(
        8,
        doc="batches of at most this many tokens use the fused lookup-GEMV kernel; larger ones "
        "dequantize once and run a dense matmul (0 = never use the kernel)",
    )
    vec_dim: int = option(4, doc="weights per codeword (trainer default)", experimental=True)
    num_codewords: int = option(256, doc="codewords per codebook (trainer)", experimental=True)
    relookup_every: int = option(
        4, doc="training steps between nearest-codeword re-lookups", experimental=True
    )

    def __post_init__(self) -> None:
        if self.max_kernel_tokens < 0:
            raise ConfigError(
                f"TvqConfig.max_kernel_tokens must be >= 0, got {self.max_kernel_tokens}"
            )
        if self.vec_dim < 1 or self.num_codewords < 2 or self.num_codewords > 65536:
            raise ConfigError(
                "TvqConfig needs vec_dim >= 1 and 2 <= num_codewords <= 65536, got "
                f"{self.vec_dim}, {self.num_codewords}"
            )
        if self.relookup_every < 1:
            raise ConfigError(f"TvqConfig.relookup_every must be >= 1, got {self.relookup_every}")


def tvq_config(mapping: Mapping[str, Any] | None = None, environ=None) -> TvqConfig:
    return load_config(TvqConfig, SYSTEM, mapping, environ)
