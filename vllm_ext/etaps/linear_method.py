"""vLLM's ``etaps`` quantization method: a ``QuantizationConfig`` and its ``LinearMethodBase``.

Per sparse linear the checkpoint holds ``values [rows, nnz]`` (bf16) and
``indices [rows, nnz]`` (int16), see :mod:`vllm_ext.etaps.sparse_format`. The
method stays off ``WEIGHT_LOADER_V2_SUPPORTED``: vLLM's legacy loaders narrow
every parameter with an ``output_dim`` by shard, so fused ``qkv_proj`` and
``gate_up_proj`` shards load with no code here. Decode-size calls run the
row-sparse GEMV (compiled on CPU, Triton on CUDA); larger ones (prefill), or
checkpoints below ``min_kernel_sparsity``, use the dense weight and vLLM's GEMM.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from vllm.model_executor.layers.linear import LinearMethodBase
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.utils import set_weight_attrs

from vllm_ext.common.log import get_logger
from vllm_ext.common.quantization_config import CheckpointQuantizationConfig
from vllm_ext.etaps.sparse_format import METHOD, SparseFormat
from vllm_ext.kernels.sparse_gemv import densify_ref, kernel_available, sparse_gemm

logger = get_logger(__name__)


@register_quantization_config(METHOD)
class EtapsQuantizationConfig(CheckpointQuantizationConfig):
    """``quantization_config: {"quant_method": "etaps", "sparsity", "modules"}``."""

    METHOD = METHOD
    FORMAT = SparseFormat

    def linear_method(self) -> EtapsSparseLinearMethod:
        return EtapsSparseLinearMethod(self)


class EtapsSparseLinearMethod(LinearMethodBase):
    """Row-sparse linear over bf16 values and int16 column indices."""

    def __init__(self, quant_config: EtapsQuantizationConfig) -> None:
        self.quant_config = quant_config
        self.fmt = quant_config.fmt
        self.runtime = quant_config.runtime

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes,
                       input_size, output_size, params_dtype, **extra_weight_attrs):  # fmt: skip
        if input_size_per_partition != input_size:
            raise ValueError("etaps: row-parallel sharding of the compact format is not "
                             "supported (tensor parallel size 1 only)")  # fmt: skip
        rows, nnz = sum(output_partition_sizes), self.fmt.nnz(input_size_per_partition)
        for name, dtype in (("values", torch.bfloat16), ("indices", torch.int16)):
            param = torch.nn.Parameter(torch.zeros(rows, nnz, dtype=dtype), requires_grad=False)
            set_weight_attrs(param, {"output_dim": 0, **extra_weight_attrs})
            layer.register_parameter(name, param)
        layer.etaps_in_features = input_size_per_partition

    def process_weights_after_loading(self, layer) -> None:
        # compiled kernel on CPU, Triton on CUDA; other devices take the dense path
        device = layer.values.device.type
        kernel = self.runtime.max_sparse_tokens > 0 and kernel_available(device)
        layer.use_kernel = kernel and self.fmt.sparsity >= self.runtime.min_kernel_sparsity
        if not self.quant_config.logged:
            self.quant_config.logged = True
            logger.info(
                "etaps: %.0f %% sparse checkpoint on %s; %s sparse kernel %s "
                "(calls of up to %d tokens, checkpoints from %.0f %% sparsity)",
                100 * self.fmt.sparsity, device, "compiled" if device == "cpu" else "Triton",
                "on" if layer.use_kernel else "off", self.runtime.max_sparse_tokens,
                100 * self.runtime.min_kernel_sparsity,
            )  # fmt: skip
        layer.dense_weight = None
        if self.fmt.sparsity < self.runtime.min_kernel_sparsity:
            # the kernel loses below this sparsity: hold the dense weight instead
            layer.dense_weight = densify_ref(layer.values.data, layer.indices.data,
                                             layer.etaps_in_features)  # fmt: skip
            layer.values = layer.indices = None

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if layer.use_kernel and x2.shape[0] <= self.runtime.max_sparse_tokens:
            y = sparse_gemm(x2, layer.values, layer.indices)
            if bias is not None:
                y = y + bias
        else:
            w = layer.dense_weight
            if w is None:
                w = densify_ref(layer.values, layer.indices, layer.etaps_in_features)
            y = F.linear(x2, w.to(x.dtype), bias)
        return y.reshape(*shape[:-1], y.shape[-1])
