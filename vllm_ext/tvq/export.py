"""Write a TVQ model as a checkpoint vLLM loads, and read one back into torch.

The folder is the base model's HF folder (config, tokenizer) with
``quantization_config`` added to ``config.json`` and one ``model.safetensors``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from vllm_ext.tvq.codebook import dequantize
from vllm_ext.tvq.format import QuantFormat
from vllm_ext.tvq.qat import VQLinear

COPIED = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
          "generation_config.json", "vocab.json", "merges.txt")  # fmt: skip


def export(model: nn.Module, base_dir: Path, out_dir: Path, fmt: QuantFormat) -> Path:
    """Save ``model`` (HF causal LM whose MLPs are :class:`VQLinear`) to ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    vq = {name: m for name, m in model.named_modules() if isinstance(m, VQLinear)}
    for name, module in vq.items():
        tensors[f"{name}.codes"] = module.codes.detach().contiguous()
        tensors[f"{name}.codebook"] = module.codebook.detach().to(torch.bfloat16).contiguous()
        tensors[f"{name}.scale"] = module.scale.detach().to(torch.bfloat16).contiguous()
        if module.bias is not None:
            tensors[f"{name}.bias"] = module.bias.detach().to(torch.bfloat16)
    skip = {f"{name}.{p}" for name in vq for p in ("weight", "bias", "codebook", "scale")}
    tied = getattr(model.config, "tie_word_embeddings", False)
    for key, value in model.state_dict().items():
        if key in skip or key.endswith(".codes") or (tied and key == "lm_head.weight"):
            continue
        tensors[key] = value.detach().to(torch.bfloat16).contiguous()
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((base_dir / "config.json").read_text())
    config["quantization_config"] = fmt.to_dict()
    config["torch_dtype"] = "bfloat16"
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in COPIED:
        if (base_dir / name).is_file():
            shutil.copy(base_dir / name, out_dir / name)
    return out_dir


def load_reference(ckpt_dir: Path, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The checkpoint as a plain HF model with every quantized weight dequantized."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(ckpt_dir)
    qcfg = getattr(config, "quantization_config", None)
    if qcfg is not None:
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, torch_dtype=dtype)
    tensors = load_file(str(ckpt_dir / "model.safetensors"))
    state = {}
    for key, value in tensors.items():
        if key.endswith(".codes"):
            base = key[: -len(".codes")]
            cb = tensors[f"{base}.codebook"].float()
            sc = tensors[f"{base}.scale"].float()
            state[f"{base}.weight"] = dequantize(value, cb, sc)
        elif not key.endswith((".codebook", ".scale")):
            state[key] = value
    missing, unexpected = model.load_state_dict({k: v.to(dtype) for k, v in state.items()},
                                                strict=False)  # fmt: skip
    missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise ValueError(f"{ckpt_dir}: missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.tie_weights()
    return model.eval()
