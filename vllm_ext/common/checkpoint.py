"""The HF folder of our compressed checkpoints (ETAPS sparse, TVQ codebooks), and reading it back.

A checkpoint is the base model's folder (config, tokenizer) with ``quantization_config``
added to ``config.json`` and one ``model.safetensors``. Each system supplies only its own
tensors on the way out and how it rebuilds a dense weight on the way back.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "vocab.json", "merges.txt")  # fmt: skip

# (checkpoint tensors, base name of one compressed linear, that linear in the model) -> weight
Densify = Callable[[dict[str, torch.Tensor], str, nn.Module], torch.Tensor]


def plain_tensors(state: dict[str, torch.Tensor], skip: set[str], tied: bool) -> dict:
    """Every tensor of ``state`` not in ``skip`` as contiguous bf16 (a tied head is not stored)."""
    return {
        key: value.detach().to(torch.bfloat16).cpu().contiguous()
        for key, value in state.items()
        if key not in skip and not (tied and key == "lm_head.weight")
    }


def write_checkpoint(
    base_dir: Path, out_dir: Path, tensors: dict[str, torch.Tensor], quant_config: dict
) -> Path:
    """``out_dir`` = base folder's config (+ ``quant_config``) and tokenizer, ``tensors``."""
    base_dir, out_dir = Path(base_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((base_dir / "config.json").read_text())
    config["quantization_config"] = quant_config
    config["torch_dtype"] = "bfloat16"
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (base_dir / name).is_file():
            shutil.copy(base_dir / name, out_dir / name)
    return out_dir


def tie_word_embeddings(base_dir: Path) -> bool:
    config = json.loads((Path(base_dir) / "config.json").read_text())
    return bool(config.get("tie_word_embeddings", False))


def load_dense_reference(
    ckpt_dir: Path, marker: str, extras: tuple[str, ...], densify: Densify,
    dtype: torch.dtype = torch.float32,
) -> nn.Module:  # fmt: skip
    """The checkpoint as a plain HF model, every compressed linear rebuilt dense by ``densify``.

    A compressed linear ``<base>`` is found by its ``<base><marker>`` tensor; ``extras`` are
    its other suffixes (not model parameters). The result is the torch reference our vLLM
    paths are tested against.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    ckpt_dir = Path(ckpt_dir)
    config = AutoConfig.from_pretrained(ckpt_dir)
    if getattr(config, "quantization_config", None) is not None:
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, torch_dtype=dtype)
    tensors = load_file(str(ckpt_dir / "model.safetensors"))
    state = {}
    for key, value in tensors.items():
        if key.endswith(marker):
            base = key[: -len(marker)]
            state[f"{base}.weight"] = densify(tensors, base, model.get_submodule(base))
        elif not key.endswith(extras):
            state[key] = value
    state = {k: v.to(dtype) for k, v in state.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise ValueError(f"{ckpt_dir}: missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.tie_weights()
    return model.eval()
