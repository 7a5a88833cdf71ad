"""TVQ training: activation-weighted k-means init, then STE distillation from the bf16 teacher.

The loss is the per-token KL to the teacher's logits plus a block-wise term
(each decoder block's output hidden state matched to the teacher's, scaled by
its variance). Latents, codebooks and scales are trained with Adam; codes are
re-looked-up every ``relookup_every`` steps. State is saved every
``save_every`` steps and a rerun with the same ``out`` resumes from it.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from vllm_ext.common.resume_file import load_resume_state
from vllm_ext.tvq.qat import VQLinear, quantize_mlps


@dataclass(frozen=True)
class TrainSettings:
    vec_dim: int = 4
    num_codewords: int = 256
    steps: int = 100
    batch: int = 2
    seq_len: int = 256
    lr: float = 1e-4
    codebook_lr: float = 1e-5
    relookup_every: int = 4
    block_weight: float = 0.1
    calib_chunks: int = 4
    save_every: int = 10
    seed: int = 0


@torch.no_grad()
def activation_energy(model, chunks: torch.Tensor) -> dict[str, torch.Tensor]:
    """Sum of squared inputs per column of every MLP linear (the diagonal of X^T X)."""
    energy: dict[str, torch.Tensor] = {}
    hooks = []
    for name, module in model.named_modules():
        if name.endswith(("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")):

            def hook(_m, args, name=name):
                x = args[0].reshape(-1, args[0].shape[-1]).float()
                energy[name] = energy.get(name, 0) + x.pow(2).sum(0)

            hooks.append(module.register_forward_pre_hook(hook))
    for chunk in chunks:
        model(chunk[None])
    for h in hooks:
        h.remove()
    return energy


@torch.no_grad()
def perplexity(model, chunks: torch.Tensor) -> float:
    total, count = 0.0, 0
    for chunk in chunks:
        logits = model(chunk[None]).logits[0, :-1].float()
        total += F.cross_entropy(logits, chunk[1:], reduction="sum").item()
        count += chunk.numel() - 1
    return math.exp(total / count)


def init_student(teacher, settings: TrainSettings, calib: torch.Tensor | None):
    """A copy of ``teacher`` with VQ MLPs (activation-weighted init when ``calib`` is given)."""
    student = copy.deepcopy(teacher)
    importance = None if calib is None else activation_energy(teacher, calib)
    n = sum(1 for n_, _ in teacher.named_modules() if n_.endswith(("gate_proj", "up_proj",
                                                                    "down_proj")))  # fmt: skip
    with tqdm(total=n, desc="tvq k-means init") as bar:
        quantize_mlps(
            student, settings.vec_dim, settings.num_codewords, importance=importance, progress=bar
        )
    return student


def distill_loss(student, teacher, batch: torch.Tensor, block_weight: float) -> torch.Tensor:
    with torch.no_grad():
        t = teacher(batch, output_hidden_states=True)
    s = student(batch, output_hidden_states=True)
    kl = F.kl_div(F.log_softmax(s.logits.float(), -1), F.log_softmax(t.logits.float(), -1),
                  log_target=True, reduction="batchmean") / batch.shape[1]  # fmt: skip
    blocks = sum(
        F.mse_loss(hs, ht) / ht.var().clamp_min(1e-6)
        for hs, ht in zip(s.hidden_states[1:], t.hidden_states[1:], strict=False)
    )
    return kl + block_weight * blocks / len(t.hidden_states[1:])


def train(teacher, student, data: torch.Tensor, settings: TrainSettings, out: Path,
          eval_chunks: torch.Tensor | None = None, eval_every: int = 0) -> list[dict]:  # fmt: skip
    """Run (or resume) training; returns the curve (one dict per logged step)."""
    out.mkdir(parents=True, exist_ok=True)
    for p in teacher.parameters():
        p.requires_grad_(False)
    vq = [m for m in student.modules() if isinstance(m, VQLinear)]
    for p in student.parameters():
        p.requires_grad_(False)
    latents = [m.weight for m in vq]
    side = [p for m in vq for p in (m.codebook, m.scale)]
    for p in latents + side:
        p.requires_grad_(True)
    opt = torch.optim.Adam([{"params": latents, "lr": settings.lr},
                            {"params": side, "lr": settings.codebook_lr}])  # fmt: skip
    state_file, step, curve = out / "state.pt", 0, []
    if state_file.is_file():
        state = load_resume_state(state_file)
        student.load_state_dict(state["student"])
        opt.load_state_dict(state["opt"])
        step, curve = state["step"], state["curve"]
    gen = torch.Generator().manual_seed(settings.seed + step)
    bar = tqdm(total=settings.steps, initial=step, desc="tvq train")
    while step < settings.steps:
        batch = data[torch.randint(len(data), (settings.batch,), generator=gen)]
        loss = distill_loss(student, teacher, batch, settings.block_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step += 1
        row = {"step": step, "tokens": step * batch.numel(), "loss": loss.item()}
        if step % settings.relookup_every == 0:
            row["changed"] = sum(m.relookup() for m in vq)
        if eval_chunks is not None and eval_every and step % eval_every == 0:
            row["ppl"] = perplexity(student, eval_chunks)
        curve.append(row)
        bar.set_postfix(loss=f"{row['loss']:.3f}", ppl=row.get("ppl", ""))
        bar.update(1)
        if step % settings.save_every == 0 or step == settings.steps:
            torch.save({"step": step, "student": student.state_dict(), "opt": opt.state_dict(),
                        "curve": curve, "settings": asdict(settings)}, state_file)  # fmt: skip
    bar.close()
    (out / "curve.json").write_text(json.dumps(curve, indent=1) + "\n")
    return curve
