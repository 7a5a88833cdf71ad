"""vLLM's ``tvq`` quantization method: a ``QuantizationConfig`` and its ``LinearMethodBase``.

Per quantized linear the checkpoint holds ``codes [rows, in/D]`` (uint8 or
int32), ``codebook [K, D]`` and ``scale [rows, 1]``. Methods outside
``WEIGHT_LOADER_V2_SUPPORTED`` get vLLM's legacy loaders, which narrow every
parameter with an ``output_dim`` by shard, so codes and scales of a fused
``gate_up_proj`` load with no code here; the codebook has no row dimension and
is stored ``[n_shards, K, D]`` by its own ``weight_loader``. Decode-size
batches run a lookup-GEMV (the compiled one on CPU, the Triton one on GPUs);
larger ones dequantize once per call and run one dense matmul.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from vllm.model_executor.layers.linear import LinearMethodBase
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.utils import set_weight_attrs

from vllm_ext.common.quantization_config import CheckpointQuantizationConfig
from vllm_ext.kernels.tvq_gemv import dequantize_shards, kernel_available, tvq_gemv
from vllm_ext.kernels.tvq_gemv.triton import row_shards, triton_usable, tvq_gemv_triton
from vllm_ext.tvq.format import METHOD, QuantFormat


@register_quantization_config(METHOD)
class TvqQuantizationConfig(CheckpointQuantizationConfig):
    """``quantization_config: {"quant_method": "tvq", "vec_dim", "num_codewords", "modules"}``."""

    METHOD = METHOD
    FORMAT = QuantFormat

    def linear_method(self) -> TvqLinearMethod:
        return TvqLinearMethod(self)


def _codebook_loader(param: torch.nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    index = 0 if shard_id is None else int(shard_id)
    if tuple(param.data[index].shape) != tuple(loaded.shape):
        raise ValueError(
            f"tvq codebook of shape {tuple(loaded.shape)} does not fit the layer's "
            f"{tuple(param.data[index].shape)} (vec_dim/num_codewords of quantization_config)"
        )
    param.data[index].copy_(loaded)


class TvqLinearMethod(LinearMethodBase):
    """Lookup-GEMV linear over codes, per-shard codebooks and per-row scales."""

    def __init__(self, quant_config: TvqQuantizationConfig) -> None:
        self.fmt = quant_config.fmt
        self.max_kernel_tokens = quant_config.runtime.max_kernel_tokens

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes,
                       input_size, output_size, params_dtype, **extra_weight_attrs):  # fmt: skip
        dim, k = self.fmt.vec_dim, self.fmt.num_codewords
        if input_size_per_partition % dim:
            raise ValueError(f"tvq: input size {input_size_per_partition} is not a multiple "
                             f"of vec_dim {dim}")  # fmt: skip
        rows = sum(output_partition_sizes)
        codes = torch.nn.Parameter(
            torch.zeros(rows, input_size_per_partition // dim, dtype=self.fmt.code_dtype),
            requires_grad=False,
        )
        set_weight_attrs(codes, {"input_dim": 1, "output_dim": 0, **extra_weight_attrs})
        scale = torch.nn.Parameter(torch.zeros(rows, 1, dtype=params_dtype), requires_grad=False)
        set_weight_attrs(scale, {"output_dim": 0, **extra_weight_attrs})
        codebook = torch.nn.Parameter(
            torch.zeros(len(output_partition_sizes), k, dim, dtype=params_dtype),
            requires_grad=False,
        )
        set_weight_attrs(codebook, {**extra_weight_attrs, "weight_loader": _codebook_loader})
        layer.register_parameter("codes", codes)
        layer.register_parameter("scale", scale)
        layer.register_parameter("codebook", codebook)
        bounds = [0]
        for size in output_partition_sizes:
            bounds.append(bounds[-1] + size)
        layer.register_buffer("shard_rows", torch.tensor(bounds, dtype=torch.long),
                              persistent=False)  # fmt: skip

    def process_weights_after_loading(self, layer) -> None:
        # the kernel reads fp32 codebooks and scales; keep them so once, not per call
        layer.codebook_f32 = layer.codebook.detach().float().contiguous()
        layer.scale_f32 = layer.scale.detach().float().contiguous()
        layer.kernel = self._pick_kernel(layer)
        if layer.kernel == "triton":
            layer.row_shard = row_shards(layer.shard_rows.to(layer.codes.device),
                                         layer.codes.shape[0])  # fmt: skip

    def _pick_kernel(self, layer) -> str | None:
        """``"cpu"`` (compiled), ``"triton"`` (GPU) or None (always dequantize and matmul)."""
        if self.max_kernel_tokens <= 0:
            return None
        if layer.codes.device.type == "cpu":
            return "cpu" if kernel_available() else None
        return "triton" if triton_usable() else None

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if layer.kernel is not None and x2.shape[0] <= self.max_kernel_tokens:
            y = self._gemv(layer, x2)
            if bias is not None:
                y = y + bias
        else:
            w = dequantize_shards(layer.codes, layer.codebook_f32, layer.scale_f32,
                                  layer.shard_rows).to(x.dtype)  # fmt: skip
            y = F.linear(x2, w, bias)
        return y.reshape(*shape[:-1], y.shape[-1])

    @staticmethod
    def _gemv(layer, x2: torch.Tensor) -> torch.Tensor:
        args = (x2, layer.codes, layer.codebook_f32, layer.scale_f32, layer.shard_rows)
        if layer.kernel == "cpu":
            return tvq_gemv(*args)
        return tvq_gemv_triton(*args, shards=layer.row_shard)
