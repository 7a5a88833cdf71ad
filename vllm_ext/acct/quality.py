"""Quality of an imported cache: the target decodes a continuation over it (no vLLM).

For each held-out window the target's continuation is scored four ways, in one
run on the same text: over its **own** prefill of the context (reference),
over the **ACCT** import, over its own prefill of the **last N tokens** only,
with N matched to the import's compute (truncation at equal cost), and with
**no context**. Metrics per variant: NLL of the continuation (nats/token),
top-1 agreement with the reference's greedy predictions, and KL to the
reference distribution.

The offline gate (:func:`gate_report`) accepts a (source, converter) pair only
if its mean NLL is within ``max_delta_nll`` of own prefill and its top-1
agreement is at least ``min_top1``; the connector refuses a checkpoint whose
gate failed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from vllm_ext.acct.data import Window
from vllm_ext.acct.llama import KV, TorchLlama
from vllm_ext.acct.pipeline import AcctPipeline, continuation_logits, own_prefill

VARIANTS = ("own", "acct", "truncated", "no_context")


@dataclass(frozen=True)
class Score:
    nll: float
    top1: float
    kl: float


def equal_compute_tokens(pipeline: AcctPipeline, context: int) -> int:
    """Tokens of own prefill that cost what importing ``context`` tokens costs."""
    return max(1, math.ceil(pipeline.cost_layer_tokens(context) / pipeline.num_layers))


def score(logits: torch.Tensor, reference: torch.Tensor, continuation: torch.Tensor) -> Score:
    """``logits``/``reference``: ``[T, vocab]`` at the continuation's positions."""
    logp, ref_logp = (
        F.log_softmax(logits[:-1].float(), -1),
        F.log_softmax(reference[:-1].float(), -1),
    )
    nll = -logp.gather(1, continuation[1:, None]).mean()
    top1 = (logp.argmax(-1) == ref_logp.argmax(-1)).float().mean()
    kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1).mean()
    return Score(float(nll), float(top1), float(kl))


def _continue(target: TorchLlama, cache: list[KV] | None, ids: torch.Tensor) -> torch.Tensor:
    if cache is None:
        logits, _ = target.forward_with_cache(ids, torch.arange(ids.shape[0]))
        return logits
    return continuation_logits(target, cache, ids)


@torch.no_grad()
def score_variants(
    target: TorchLlama, window: Window, pipelines: dict[str, AcctPipeline]
) -> dict[str, Score]:
    """Own prefill, each pipeline's import (``acct:<name>``), truncation at each import's
    compute (``truncated:<N>``) and no context, all on ``window``."""
    context = torch.as_tensor(window.context, dtype=torch.long)
    cont = torch.as_tensor(window.continuation, dtype=torch.long)
    reference = _continue(target, own_prefill(target, context), cont)
    logits = {"own": reference}
    for name, pipeline in pipelines.items():
        logits[f"acct:{name}"] = _continue(target, pipeline.build_cache(context), cont)
        keep = equal_compute_tokens(pipeline, context.shape[0])
        if f"truncated:{keep}" not in logits:
            logits[f"truncated:{keep}"] = _continue(
                target, own_prefill(target, context[-keep:]), cont
            )
    logits["no_context"] = _continue(target, None, cont)
    return {name: score(value, reference, cont) for name, value in logits.items()}


def score_window(pipeline: AcctPipeline, window: Window) -> dict[str, Score]:
    """:func:`score_variants` for one pipeline, under the names of :data:`VARIANTS`."""
    scores = score_variants(pipeline.target, window, {"x": pipeline})
    keep = equal_compute_tokens(pipeline, len(window.context))
    names = {"own": "own", "acct": "acct:x", "truncated": f"truncated:{keep}"}
    return {**{k: scores[v] for k, v in names.items()}, "no_context": scores["no_context"]}


def evaluate(pipeline: AcctPipeline, windows: Iterable[Window], progress=None) -> dict:
    """Per-variant means over ``windows`` plus each window's scores."""
    per_window = []
    for window in windows:
        per_window.append({k: asdict(v) for k, v in score_window(pipeline, window).items()})
        if progress is not None:
            progress.update(1)
    if not per_window:
        raise ValueError("no evaluation windows")
    means = {
        name: {
            m: sum(w[name][m] for w in per_window) / len(per_window) for m in asdict(Score(0, 0, 0))
        }
        for name in VARIANTS
    }
    return {"means": means, "windows": per_window}


def gate_report(result: dict, max_delta_nll: float, min_top1: float, settings: dict) -> dict:
    """The offline gate over an :func:`evaluate` result."""
    means = result["means"]
    delta = means["acct"]["nll"] - means["own"]["nll"]
    top1 = means["acct"]["top1"]
    return {
        "delta_nll": delta,
        "top1": top1,
        "beats_truncation": means["acct"]["nll"] < means["truncated"]["nll"],
        "max_delta_nll": max_delta_nll,
        "min_top1": min_top1,
        "passed": bool(math.isfinite(delta) and delta <= max_delta_nll and top1 >= min_top1),
        "windows": len(result["windows"]),
        **settings,
    }
