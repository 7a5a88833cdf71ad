"""TVQ's vLLM seams: quantization registration and the linear method (see
:mod:`vllm_ext.common.compat`)."""

from __future__ import annotations

from vllm_ext.common.seam import Seam
from vllm_ext.common.seams import quant_method_calls

# words of a `vllm serve` command line that select tvq
SELECTED_BY: tuple[str, ...] = ('--quantization tvq', 'vllm_ext.tvq')

SEAMS: tuple[Seam, ...] = (
    # TVQ
    Seam("tvq", "vllm.model_executor.layers.quantization", "register_quantization_config",
         "symbol", "adds the tvq method"),
    Seam("tvq", "vllm.model_executor.layers.quantization", "QUANTIZATION_METHODS", "attribute",
         "re-entrancy: registered once per process"),
    Seam("tvq", "vllm.model_executor.layers.quantization.base_config", "QuantizationConfig",
         "symbol", "CheckpointQuantizationConfig's base (TVQ)"),
    Seam("tvq", "vllm.model_executor.layers.linear", "LinearMethodBase.create_weights",
         "signature", "TvqLinearMethod", ("layer", "input_size_per_partition",
         "output_partition_sizes", "input_size", "output_size", "params_dtype")),
    Seam("tvq", "vllm.model_executor.layers.linear", "LinearBase", "symbol",
         "which layers get the method"),
    Seam("tvq", "vllm.model_executor.layers.linear", "WEIGHT_LOADER_V2_SUPPORTED", "attribute",
         "tvq stays off it: the legacy loaders shard codes and scales by output_dim"),
    Seam("tvq", "vllm.model_executor.utils", "set_weight_attrs", "symbol",
         "output_dim/input_dim and the codebook's weight_loader"),
    Seam("tvq", "vllm.config", "get_current_vllm_config_or_none", "symbol",
         "the tvq block of additional_config while the loader builds the layers"),
    # how vLLM's linear layers call TVQ's method
    *quant_method_calls("tvq", "vllm_ext.tvq.linear_method:TvqLinearMethod"),
)  # fmt: skip
