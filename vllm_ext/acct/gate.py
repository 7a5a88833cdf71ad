"""The quality gates of an import (no vLLM).

Offline (:func:`check_offline_gate`): a checkpoint carries the gate report
measured by ``python -m vllm_ext.acct eval``; a pair without one, or whose
report fails the configured thresholds, is refused at load.

Online (:func:`online_check`): per request, after the import, the target
itself predicts the last ``m`` prefix tokens twice: over the imported cache,
and over the exact sink tokens alone (a local, truncated context). An import
whose NLL there is not finite or is worse than the local one by more than
``max_gap`` nats is rejected; the connector then reports its blocks as load
errors and vLLM recomputes them (``kv_load_failure_policy="recompute"``).
It costs ``2 m`` tokens through the target's layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vllm_ext.acct.llama import KV, TorchLlama, slice_kv


class GateError(ValueError):
    """A (source, converter) pair failed or lacks its offline gate."""


def check_offline_gate(gate: dict | None, max_delta_nll: float, min_top1: float, name: str):
    if gate is None:
        raise GateError(
            f"ACCT checkpoint {name} has no offline gate report; run "
            f"`python -m vllm_ext.acct eval --checkpoint {name} --write-gate`"
        )
    delta, top1 = gate.get("delta_nll"), gate.get("top1")
    if not (
        isinstance(delta, (int, float))
        and math.isfinite(delta)
        and delta <= max_delta_nll
        and isinstance(top1, (int, float))
        and top1 >= min_top1
    ):
        raise GateError(
            f"ACCT checkpoint {name} fails the offline gate: delta NLL {delta!r} "
            f"(allowed <= {max_delta_nll}), top-1 agreement {top1!r} (required >= {min_top1}) "
            f"on {gate.get('windows')} held-out windows"
        )


@dataclass(frozen=True)
class OnlineVerdict:
    nll_import: float
    nll_local: float
    passed: bool


def _nll(target: TorchLlama, ids: torch.Tensor, start: int, past: list[KV]) -> float:
    positions = torch.arange(start, start + ids.shape[0], device=ids.device)
    logits, _ = target.forward_with_cache(ids[:-1], positions[:-1], past)
    return float(F.cross_entropy(logits.float(), ids[1:]))


@torch.no_grad()
def online_check(
    target: TorchLlama, cache: list[KV], ids: torch.Tensor, tokens: int, sinks: int, max_gap: float
) -> OnlineVerdict:
    """Judge an imported ``cache`` of ``ids`` (every position) on its last ``tokens`` tokens."""
    n = ids.shape[0]
    tokens = min(tokens, n - sinks)
    if tokens < 2:
        return OnlineVerdict(float("nan"), float("nan"), True)
    start = n - tokens
    tail = ids[start:]
    nll_import = _nll(target, tail, start, [slice_kv(kv, 0, start) for kv in cache])
    nll_local = _nll(target, tail, start, [slice_kv(kv, 0, sinks) for kv in cache])
    passed = math.isfinite(nll_import) and nll_import <= nll_local + max_gap
    return OnlineVerdict(nll_import, nll_local, passed)
