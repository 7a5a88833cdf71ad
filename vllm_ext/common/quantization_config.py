"""The base of our checkpoint formats' vLLM quantization methods (ETAPS sparse, TVQ codebooks).

A checkpoint's ``quantization_config`` names the method and its format; the method's runtime
settings come from the system's block of ``--additional-config``. Each system adds only its
format class and its ``LinearMethodBase``.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig


class CheckpointQuantizationConfig(QuantizationConfig):
    """``quantization_config: {"quant_method": METHOD, ...}`` read by ``FORMAT.from_dict``."""

    METHOD: ClassVar[str]  # the quant_method name, also the system's additional_config key
    FORMAT: ClassVar[Any]  # from_dict(config) -> format with covers(prefix)

    def __init__(self, fmt: Any, runtime: Any = None) -> None:
        super().__init__()
        self.fmt = fmt
        self._runtime = runtime
        self.logged = False  # one info line per model, not per layer

    @property
    def runtime(self) -> Any:
        """The system's block of ``--additional-config`` (+ ``VLLMEXT_<SYSTEM>_*``), read once.

        vLLM builds this object from ``config.json`` before a ``VllmConfig`` exists, so
        the block is read when the first layer asks for its method: that runs inside
        the loader's ``set_current_vllm_config``.
        """
        if self._runtime is None:
            from vllm.config import get_current_vllm_config_or_none

            from vllm_ext.common.systems import config_from_vllm

            self._runtime = config_from_vllm(self.METHOD, get_current_vllm_config_or_none())
        return self._runtime

    def get_name(self) -> str:
        return self.METHOD

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> CheckpointQuantizationConfig:
        return cls(cls.FORMAT.from_dict(config))

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        if isinstance(layer, LinearBase):
            return self.linear_method() if self.fmt.covers(prefix) else UnquantizedLinearMethod()
        return None

    def linear_method(self):
        """The system's ``LinearMethodBase`` for one covered layer."""
        raise NotImplementedError
