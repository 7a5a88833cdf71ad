"""Write a TVQ model as a checkpoint vLLM loads, and read one back into torch.

The folder (:mod:`vllm_ext.common.checkpoint`) holds every :class:`VQLinear` as codes,
codebook and scale, the rest bf16.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from vllm_ext.common.checkpoint import load_dense_reference, plain_tensors, write_checkpoint
from vllm_ext.tvq.codebook import dequantize
from vllm_ext.tvq.format import QuantFormat
from vllm_ext.tvq.qat import VQLinear


def export(model: nn.Module, base_dir: Path, out_dir: Path, fmt: QuantFormat) -> Path:
    """Save ``model`` (HF causal LM whose MLPs are :class:`VQLinear`) to ``out_dir``."""
    vq = {name: m for name, m in model.named_modules() if isinstance(m, VQLinear)}
    skip = {f"{name}.{p}" for name in vq for p in ("weight", "bias", "codebook", "scale", "codes")}
    tied = getattr(model.config, "tie_word_embeddings", False)
    tensors = plain_tensors(model.state_dict(), skip, tied)
    for name, module in vq.items():
        tensors[f"{name}.codes"] = module.codes.detach().contiguous()
        tensors[f"{name}.codebook"] = module.codebook.detach().to(torch.bfloat16).contiguous()
        tensors[f"{name}.scale"] = module.scale.detach().to(torch.bfloat16).contiguous()
        if module.bias is not None:
            tensors[f"{name}.bias"] = module.bias.detach().to(torch.bfloat16)
    return write_checkpoint(base_dir, out_dir, tensors, fmt.to_dict())


def _dequantize(tensors: dict[str, torch.Tensor], base: str, _linear: nn.Module) -> torch.Tensor:
    codebook, scale = tensors[f"{base}.codebook"].float(), tensors[f"{base}.scale"].float()
    return dequantize(tensors[f"{base}.codes"], codebook, scale)


def load_reference(ckpt_dir: Path, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The checkpoint as a plain HF model with every quantized weight dequantized."""
    return load_dense_reference(ckpt_dir, ".codes", (".codebook", ".scale"), _dequantize, dtype)
