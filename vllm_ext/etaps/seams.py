"""ETAPS's vLLM seams: quantization registration and the sparse linear method (see
:mod:`vllm_ext.common.compat`)."""

from __future__ import annotations

from vllm_ext.common.seam import Seam
from vllm_ext.common.seams import quant_method_calls

# words of a `vllm serve` command line that select etaps
SELECTED_BY: tuple[str, ...] = ('--quantization etaps', 'vllm_ext.etaps')

SEAMS: tuple[Seam, ...] = (
    # ETAPS
    Seam("etaps", "vllm.model_executor.layers.quantization", "register_quantization_config",
         "symbol", "adds the etaps method"),
    Seam("etaps", "vllm.model_executor.layers.quantization", "QUANTIZATION_METHODS",
         "attribute", "re-entrancy: registered once per process"),
    Seam("etaps", "vllm.model_executor.layers.quantization.base_config", "QuantizationConfig",
         "symbol", "CheckpointQuantizationConfig's base (ETAPS)"),
    Seam("etaps", "vllm.model_executor.layers.linear", "LinearMethodBase.create_weights",
         "signature", "EtapsSparseLinearMethod", ("layer", "input_size_per_partition",
         "output_partition_sizes", "input_size", "output_size", "params_dtype")),
    Seam("etaps", "vllm.model_executor.layers.linear", "LinearBase", "symbol",
         "which layers get the method"),
    Seam("etaps", "vllm.model_executor.layers.linear", "WEIGHT_LOADER_V2_SUPPORTED",
         "attribute", "etaps stays off it: the legacy loaders shard values/indices by output_dim"),
    Seam("etaps", "vllm.model_executor.utils", "set_weight_attrs", "symbol",
         "output_dim of values and indices"),
    Seam("etaps", "vllm.config", "get_current_vllm_config_or_none", "symbol",
         "additional_config['etaps'] while the loader builds the layers"),
    # how vLLM's linear layers call ETAPS's method
    *quant_method_calls("etaps", "vllm_ext.etaps.linear_method:EtapsSparseLinearMethod"),
)  # fmt: skip
