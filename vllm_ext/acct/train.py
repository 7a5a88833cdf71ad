"""Fit converters: closed-form ridge initialisation, then end-to-end KL training (no vLLM).

The target stays frozen. Each step takes one ShareGPT window (context +
continuation), runs the target once without gradients over all of it (the
teacher: its continuation logits, its exact KV for the source layers and the
sink tokens, and the converter input), rebuilds the context cache with the
converters, decodes the continuation over that cache and minimises the KL
divergence from the teacher's output distribution. Only the continuation's
forward and the converters see gradients. K/V error is not the objective: a
K/V fit loses to plain truncation (acct.md §3).

Training is resumable: ``trainer.pt`` in the output folder holds the
optimizer and the step; the converters are saved as a normal checkpoint
(:mod:`vllm_ext.acct.checkpoint`) every ``checkpoint_every`` steps.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from vllm_ext.acct import checkpoint as ckpt
from vllm_ext.acct.converter import Converters, RidgeAccumulator
from vllm_ext.acct.data import Window
from vllm_ext.acct.llama import KV, TorchLlama, concat_kv, slice_kv
from vllm_ext.common.resume_file import load_resume_state

TRAINER_FILE = "trainer.pt"


@dataclass(frozen=True)
class TrainSettings:
    source_layers: int = 4
    sink_tokens: int = 4
    context: int = 768
    continuation: int = 64
    conversations: int = 200
    ridge_windows: int = 8
    ridge_alpha: float = 1e-3
    steps: int = 200
    lr: float = 3e-4
    checkpoint_every: int = 20
    teacher_windows: int = 0
    seed: int = 0


@dataclass
class Teacher:
    """One window as the frozen target saw it (all a KL step needs besides the converters)."""

    continuation: torch.Tensor
    logits: torch.Tensor  # continuation positions (bf16 when kept for reuse)
    exact: list[KV]  # source layers, context positions
    sinks: dict[int, KV]  # converted layers, the sink tokens
    features: torch.Tensor  # converter input, context positions
    pre_rope: dict[int, tuple[torch.Tensor, torch.Tensor]]  # converted layers: (K pre-RoPE, V)


@torch.no_grad()
def teacher(
    target: TorchLlama, converters: Converters, window: Window, sink_tokens: int, *,
    keep_pre_rope: bool = False, compact: bool = False,
) -> Teacher:  # fmt: skip
    ids = torch.as_tensor(list(window.context) + list(window.continuation), dtype=torch.long)
    n_ctx, k = len(window.context), converters.first_layer
    cos_sin = target.cos_sin(torch.arange(ids.shape[0]))
    hidden = target.embed(ids)
    exact, sinks, pre_rope, features = [], {}, {}, None
    for i in range(target.shape.num_layers):
        if i == k:
            features = converters.features(hidden[:n_ctx])
        out = target.layer(i, hidden, cos_sin, None, keep_pre_rope=keep_pre_rope)
        hidden = out.hidden
        if i < k:
            exact.append(slice_kv(out.kv, 0, n_ctx))
        else:
            sinks[i] = slice_kv(out.kv, 0, sink_tokens)
        if keep_pre_rope and i >= k:
            pre_rope[i] = (out.pre_rope_key[:, :n_ctx], out.kv[1][:, :n_ctx])
    if features is None:
        features = converters.features(hidden[:n_ctx])
    logits = target.logits(hidden[n_ctx:])
    if compact:
        logits = logits.to(torch.bfloat16)
    cont = torch.as_tensor(window.continuation, dtype=torch.long)
    return Teacher(cont, logits, exact, sinks, features, pre_rope)


def ridge_init(target, converters: Converters, windows, sink_tokens: int, alpha: float) -> int:
    """Least-squares converters on the target's own pre-RoPE K and V; returns rows used."""
    acc = RidgeAccumulator(converters)
    for window in windows:
        t = teacher(target, converters, window, sink_tokens, keep_pre_rope=True)
        # the sink tokens are computed exactly and carry outlier activations: not fitted
        targets = {j: (k[:, sink_tokens:], v[:, sink_tokens:]) for j, (k, v) in t.pre_rope.items()}
        acc.add(t.features[sink_tokens:], targets)
    acc.solve(alpha)
    return acc.rows


def student_cache(target, converters: Converters, t: Teacher) -> list[KV]:
    n = t.features.shape[0]
    cache = list(t.exact)
    for j in converters.layers:
        s = t.sinks[j][0].shape[1]
        cos, sin = target.cos_sin(torch.arange(s, n))
        converted = converters.convert(j, t.features[s:], (cos, sin))
        cache.append(concat_kv(t.sinks[j], converted))
    return cache


def kl_loss(target, converters: Converters, t: Teacher) -> torch.Tensor:
    """KL(teacher || target over the converted cache) per continuation token."""
    cache = student_cache(target, converters, t)
    n = t.features.shape[0]
    positions = torch.arange(n, n + t.continuation.shape[0])
    logits, _ = target.forward_with_cache(t.continuation, positions, cache)
    ref = F.log_softmax(t.logits.float(), -1)
    return F.kl_div(F.log_softmax(logits.float(), -1), ref, log_target=True, reduction="batchmean")


def teachers(target, converters, windows, settings: TrainSettings, seed: int):
    """One teacher per step: fresh windows, or ``teacher_windows`` of them computed once."""
    if settings.teacher_windows <= 0:
        for window in windows:
            yield teacher(target, converters, window, settings.sink_tokens)
        return
    kept = [
        teacher(target, converters, next(windows), settings.sink_tokens, compact=True)
        for _ in range(settings.teacher_windows)
    ]
    rng = torch.Generator().manual_seed(seed)
    while True:
        for i in torch.randperm(len(kept), generator=rng).tolist():
            yield kept[i]


def _run_identity(settings: dict) -> dict:
    # a run may be resumed with more steps or another checkpoint interval, nothing else
    return {k: v for k, v in settings.items() if k not in ("steps", "checkpoint_every")}


class Trainer:
    """Resumable KL training of one converter set."""

    def __init__(self, target: TorchLlama, model_dir, out_dir, settings: TrainSettings):
        self.target = target
        self.model_dir = model_dir
        self.out = Path(out_dir)
        self.settings = settings
        self.converters = Converters(target.shape, settings.source_layers)
        self.optimizer = torch.optim.Adam(self.converters.parameters(), lr=settings.lr)
        self.step = 0
        self.history: list[dict] = []
        self.ridge_rows = 0

    def resume(self) -> bool:
        state_file = self.out / TRAINER_FILE
        if not state_file.is_file():
            return False
        state = load_resume_state(state_file)
        fixed, saved = _run_identity(asdict(self.settings)), _run_identity(state["settings"])
        if fixed != saved:
            raise ValueError(f"{state_file} was written with other settings: {saved}")
        converters, _ = ckpt.load_converters(self.out, self.target.shape)
        self.converters.load_state_dict(converters.state_dict())
        self.optimizer.load_state_dict(state["optimizer"])
        self.step, self.history, self.ridge_rows = (
            state["step"],
            state["history"],
            state["ridge_rows"],
        )
        return True

    def save(self) -> None:
        meta = ckpt.CheckpointMeta(
            target=ckpt.target_identity(self.model_dir),
            source_layers=self.settings.source_layers,
            sink_tokens=self.settings.sink_tokens,
            trained={
                "steps": self.step,
                "ridge_rows": self.ridge_rows,
                "settings": asdict(self.settings),
                "history": self.history[-50:],
            },
        )
        ckpt.save(self.out, self.converters, meta)
        state = {
            "settings": asdict(self.settings),
            "optimizer": self.optimizer.state_dict(),
            "step": self.step,
            "history": self.history,
            "ridge_rows": self.ridge_rows,
        }
        tmp = self.out / f".{TRAINER_FILE}.tmp"
        torch.save(state, tmp)
        tmp.replace(self.out / TRAINER_FILE)

    def init_ridge(self, windows) -> None:
        self.ridge_rows = ridge_init(
            self.target,
            self.converters,
            windows,
            self.settings.sink_tokens,
            self.settings.ridge_alpha,
        )
        self.save()

    def train(self, windows, progress=None) -> None:
        """Run until ``settings.steps`` over ``windows`` (an iterator; see :func:`teachers`)."""
        s = self.settings
        if self.step >= s.steps:
            return
        stream = teachers(self.target, self.converters, windows, s, s.seed + self.step)
        for t in stream:
            started = time.process_time()
            loss = kl_loss(self.target, self.converters, t)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            self.step += 1
            kl = float(loss.detach())
            self.history.append(
                {"step": self.step, "kl": kl, "cpu_s": time.process_time() - started}
            )
            if progress is not None:
                progress.update(1)
                progress.set_postfix(kl=f"{kl:.3f}")
            if self.step % s.checkpoint_every == 0 or self.step == s.steps:
                self.save()
            if self.step >= s.steps:
                break
