"""Write a pruned model as a sparse checkpoint vLLM loads, and read one back into torch.

The folder is the base model's HF folder (config, tokenizer) with
``quantization_config`` (:mod:`.sparse_format`) added to ``config.json`` and one
``model.safetensors``: every pruned linear as values + indices, the rest bf16.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from vllm_ext.etaps.model_io import prunable_linears
from vllm_ext.etaps.sparse_format import SparseFormat, compact
from vllm_ext.kernels.sparse_gemv.ref import densify_ref

COPIED = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
          "generation_config.json", "vocab.json", "merges.txt")  # fmt: skip


def export(model: nn.Module, base_dir: Path, out_dir: Path, sparsity: float) -> Path:
    """Save ``model`` (HF causal LM, decoder linears pruned per row) to ``out_dir``."""
    sparse = list(prunable_linears(model))
    return export_state(model.state_dict(), sparse, base_dir, out_dir, sparsity)


def export_state(
    state: dict[str, torch.Tensor], sparse: list[str], base_dir: Path, out_dir: Path,
    sparsity: float,
) -> Path:  # fmt: skip
    """Save a state dict whose linears ``sparse`` hold row-pruned ``<name>.weight``.

    (:meth:`StagedPruner.export_state` gives one mid-run, without touching the pruner.)
    """
    base_dir, out_dir = Path(base_dir), Path(out_dir)
    fmt = SparseFormat(sparsity)
    config = json.loads((base_dir / "config.json").read_text())
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for name in sparse:
        w = state[f"{name}.weight"].detach().float()
        tensors[f"{name}.values"], tensors[f"{name}.indices"] = compact(w, fmt.nnz(w.shape[1]))
    skip = {f"{name}.weight" for name in sparse}
    tied = config.get("tie_word_embeddings", False)
    for key, value in state.items():
        if key in skip or (tied and key == "lm_head.weight"):
            continue
        tensors[key] = value.detach().to(torch.bfloat16).cpu().contiguous()
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config["quantization_config"] = fmt.to_dict()
    config["torch_dtype"] = "bfloat16"
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in COPIED:
        if (base_dir / name).is_file():
            shutil.copy(base_dir / name, out_dir / name)
    return out_dir


def load_reference(ckpt_dir: Path, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The checkpoint as a plain HF model with every sparse weight densified (the masked dense)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    ckpt_dir = Path(ckpt_dir)
    config = AutoConfig.from_pretrained(ckpt_dir)
    if getattr(config, "quantization_config", None) is not None:
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, torch_dtype=dtype)
    tensors = load_file(str(ckpt_dir / "model.safetensors"))
    state = {}
    for key, value in tensors.items():
        if key.endswith(".values"):
            base = key[: -len(".values")]
            in_features = model.get_submodule(base).in_features
            state[f"{base}.weight"] = densify_ref(value, tensors[f"{base}.indices"], in_features)
        elif not key.endswith(".indices"):
            state[key] = value
    missing, unexpected = model.load_state_dict({k: v.to(dtype) for k, v in state.items()},
                                                strict=False)  # fmt: skip
    missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise ValueError(f"{ckpt_dir}: missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.tie_weights()
    return model.eval()
