"""Compressed mode: a token scorer and learned per-head budgets (torch harness; no vLLM).

Each target KV head ``(layer, head)`` keeps its own subset of the context's
tokens (the rest are removed from that head's softmax). Three parts:

- **Deletion impact** (the training signal): how much the continuation's loss
  rises when token ``t`` is deleted from head ``h``. Measured to first order
  with one backward pass: a bias ``b[h, t]`` on the attention logits is 0 for
  every kept token and ``-inf`` for a deleted one, so ``-dLoss/db`` at 0 is the
  loss increase per unit of removed attention mass (attribution patching).
- **Token scorer**: reads the *source* hidden state of every context token (the
  RMS-normalised residual stream after the target's first ``k`` layers, what
  ACCT's converters read) plus its distance from the end, and predicts each
  head's within-window impact rank; a closed-form ridge fit.
- **Learned per-head budgets**: under one total budget (a mean keep fraction
  over all heads), each head's fraction is chosen on training windows by greedy
  marginal allocation of the impact the scorer's ranking retains per head.

The first ``sink_tokens`` tokens are kept by every head in every policy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vllm_ext.acct.llama import KV, TorchLlama, rms_normalize

GRID = 40  # budget allocation step: 1/GRID of a head's tokens


def head_count(target: TorchLlama) -> int:
    return target.shape.num_layers * target.shape.num_kv_heads


@torch.no_grad()
def prefill(
    target: TorchLlama, ids: torch.Tensor, source_layers: int
) -> tuple[list[KV], torch.Tensor]:
    """The target's own KV of ``ids`` and the residual stream after ``source_layers`` layers."""
    cos_sin = target.cos_sin(torch.arange(ids.shape[0]))
    hidden, cache, source = target.embed(ids), [], None
    for i in range(target.shape.num_layers):
        if i == source_layers:
            source = hidden
        out = target.layer(i, hidden, cos_sin, None)
        hidden = out.hidden
        cache.append(out.kv)
    return cache, source


def continuation_nll(
    target: TorchLlama,
    cache: list[KV],
    cont: torch.Tensor,
    bias: list[torch.Tensor] | None,
    start: int | None = None,
) -> torch.Tensor:
    """Mean NLL of ``cont[1:]`` decoded after ``cache`` (from position ``start``, default
    its length) with per-head logit ``bias``."""
    start = cache[0][0].shape[1] if start is None else start
    positions = torch.arange(start, start + cont.shape[0])
    logits, _ = target.forward_with_cache(cont, positions, cache, bias)
    logits = logits[:-1].to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits, cont[1:])


def deletion_impact(target: TorchLlama, cache: list[KV], cont: torch.Tensor) -> torch.Tensor:
    """First-order loss increase of deleting each token from each head: ``[heads, tokens]``."""
    n, kvh = cache[0][0].shape[1], target.shape.num_kv_heads
    bias = [torch.zeros(kvh, n, requires_grad=True) for _ in cache]
    loss = continuation_nll(target, cache, cont, bias) * (cont.shape[0] - 1)
    grads = torch.autograd.grad(loss, bias)
    return -torch.cat(grads, 0).detach()


def features(source: torch.Tensor, eps: float) -> torch.Tensor:
    """Scorer input per token: normalised source state, log distance from the end, bias."""
    n = source.shape[0]
    dist = torch.log1p(torch.arange(n - 1, -1, -1, dtype=source.dtype))[:, None]
    return torch.cat([rms_normalize(source, eps), dist / 8, (dist / 8) ** 2, torch.ones(n, 1)], 1)


def impact_rank(impact: torch.Tensor) -> torch.Tensor:
    """Each head's tokens ranked by impact, scaled to [0, 1] (1 = most harmful to delete)."""
    order = impact.argsort(-1).argsort(-1).to(torch.float32)
    return order / max(1, impact.shape[-1] - 1)


@dataclass
class TokenScorer:
    weight: torch.Tensor  # [features, heads]
    eps: float

    @classmethod
    def fit(cls, samples: list[tuple[torch.Tensor, torch.Tensor]], eps: float, alpha: float = 1e-2):
        """Ridge fit of impact ranks from ``(source [n, d], impact [heads, n])`` samples."""
        xs = torch.cat([features(s, eps) for s, _ in samples]).double()
        ys = torch.cat([impact_rank(i).T for _, i in samples]).double()
        gram = xs.T @ xs + alpha * xs.shape[0] * torch.eye(xs.shape[1], dtype=xs.dtype)
        return cls(torch.linalg.solve(gram, xs.T @ ys).float(), eps)

    def scores(self, source: torch.Tensor) -> torch.Tensor:
        """``[heads, tokens]``: higher = keep."""
        return (features(source, self.eps) @ self.weight).T


def keep_mask(scores: torch.Tensor, fractions: torch.Tensor, sink_tokens: int) -> torch.Tensor:
    """Per head, the sinks plus its highest-scoring tokens up to ``fractions[h]`` of all."""
    heads, n = scores.shape
    counts = (fractions * n).round().long().clamp(min(sink_tokens, n), n)
    scores = scores.clone()
    scores[:, :sink_tokens] = math.inf
    ranks = scores.argsort(-1, descending=True).argsort(-1)
    return ranks < counts[:, None]


def retained_curves(scores: torch.Tensor, impact: torch.Tensor) -> torch.Tensor:
    """``[heads, GRID + 1]``: positive impact a head keeps at fractions 0, 1/GRID, ..., 1."""
    n = scores.shape[1]
    gain = impact.clamp(min=0).gather(1, scores.argsort(-1, descending=True)).cumsum(-1)
    gain = torch.cat([torch.zeros(gain.shape[0], 1), gain], 1)
    idx = torch.linspace(0, n, GRID + 1).round().long()
    return gain[:, idx]


def learn_budgets(curves: torch.Tensor, total: float) -> torch.Tensor:
    """Per-head fractions with mean ``total`` that maximise the summed retained impact.

    ``curves``: :func:`retained_curves` summed over training windows. Greedy: each
    step gives ``1/GRID`` to the head whose curve rises most there (exact for
    concave curves; ranked keeping makes them close to concave).
    """
    heads = curves.shape[0]
    steps = torch.zeros(heads, dtype=torch.long)
    for _ in range(round(total * GRID * heads)):
        nxt = steps.clamp(max=GRID - 1)
        gain = curves[torch.arange(heads), nxt + 1] - curves[torch.arange(heads), nxt]
        gain[steps >= GRID] = -math.inf
        steps[int(gain.argmax())] += 1
    return steps.float() / GRID


def mask_bias(mask: torch.Tensor, layers: int) -> list[torch.Tensor]:
    """A keep mask ``[heads, n]`` as per-layer logit biases (0 kept, -inf dropped)."""
    bias = torch.zeros(mask.shape, dtype=torch.float32).masked_fill(~mask, -math.inf)
    return list(bias.chunk(layers, 0))


def baseline_scores(kind: str, heads: int, n: int, seed: int) -> torch.Tensor:
    """``random`` (a fresh permutation per head) or ``recency`` (the last tokens)."""
    if kind == "random":
        gen = torch.Generator().manual_seed(seed)
        return torch.rand(heads, n, generator=gen)
    if kind == "recency":
        return torch.arange(n, dtype=torch.float32).expand(heads, n)
    raise ValueError(f"unknown baseline {kind!r}")
