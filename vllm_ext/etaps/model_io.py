"""Which linears ETAPS prunes, and loading a Llama-style checkpoint for pruning (no vLLM)."""

from __future__ import annotations

from pathlib import Path

import torch

# every decoder linear; embeddings and the (tied) LM head stay dense
PRUNED_SUFFIXES = (
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
)  # fmt: skip


def prunable_linears(model: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    """``{module name: nn.Linear}`` of the decoder linears, in model order."""
    found = {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in PRUNED_SUFFIXES
    }
    if not found:
        raise ValueError("no q/k/v/o/gate/up/down linears found: not a Llama-style model")
    return found


def load_model(path: str | Path, dtype: torch.dtype = torch.float32):
    """``(model, tokenizer)`` from a Hugging Face folder, in ``dtype``, eval mode, frozen."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model, AutoTokenizer.from_pretrained(str(path))


@torch.no_grad()
def perplexity(model: torch.nn.Module, blocks: torch.Tensor) -> float:
    """Perplexity of ``model`` on ``[n, T]`` token blocks (mean NLL over all predicted tokens)."""
    total, count = 0.0, 0
    for row in blocks:
        logits = model(row.unsqueeze(0)).logits[0, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits, row[1:], reduction="sum")
        total += float(nll)
        count += row.numel() - 1
    return float(torch.exp(torch.tensor(total / count)))
