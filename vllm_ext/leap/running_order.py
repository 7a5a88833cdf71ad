"""LeapPolicy's order, remaining lengths and victim for the running batch, vectorised.

No vLLM types. Every running request changes each step (one more token), so
nothing carries over between steps; numpy derives the whole batch's serving
order in a few array operations instead of a Python view per request. The
results equal :meth:`LeapPolicy.order`, :meth:`LeapPolicy.remaining` and
:meth:`LeapPolicy.choose_victim` on the same requests (tested).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from vllm_ext.leap.policy import MAX_LOG, LeapPolicy
from vllm_ext.leap.remaining import expected_remaining


@dataclass(frozen=True)
class RunningBatch:
    """Columns of the running requests, in running-queue order.

    ``predicted_total`` is NaN where a request has no prediction;
    ``predicted_log_std`` is 0 where unknown; ``error_log_std`` and
    ``max_tokens`` as in :class:`~vllm_ext.leap.policy.RequestView`.
    """

    arrival_time: np.ndarray
    prompt_tokens: np.ndarray
    generated_tokens: np.ndarray
    predicted_total: np.ndarray
    predicted_log_std: np.ndarray
    error_log_std: np.ndarray
    max_tokens: np.ndarray

    @classmethod
    def from_columns(
        cls, arrival, prompt, generated, total, log_std, error_log_std=0.0, max_tokens=np.inf
    ) -> RunningBatch:
        columns = (arrival, prompt, generated, total, log_std, error_log_std, max_tokens)
        return cls(*np.broadcast_arrays(*(np.asarray(c, dtype=np.float64) for c in columns)))

    def __len__(self) -> int:
        return len(self.arrival_time)

    def without(self, rows) -> RunningBatch:
        """The batch less ``rows`` (indices), the others in their order."""
        keep = np.ones(len(self), dtype=bool)
        keep[list(rows)] = False
        return RunningBatch(*(column[keep] for column in dataclasses.astuple(self)))


def aged(policy: LeapPolicy, batch: RunningBatch, now: float) -> np.ndarray:
    """:meth:`LeapPolicy.is_aged` per request."""
    return now - batch.arrival_time >= policy.config.max_wait_s


def remaining(policy: LeapPolicy, batch: RunningBatch) -> np.ndarray:
    """:meth:`LeapPolicy.remaining` per request (NaN: no prediction, inf: overflow)."""
    left, inflation = _left_and_inflation(policy, batch)
    overflow = np.log(left) + inflation >= MAX_LOG
    inflated = left * np.exp(np.where(overflow, 0.0, inflation))
    return np.where(inflation == 0, left, np.where(overflow, np.inf, inflated))


def order(policy: LeapPolicy, batch: RunningBatch, now: float) -> np.ndarray:
    """Indices in serving order with the preemption victim last (vLLM preempts ``running[-1]``)."""
    n = len(batch)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    index = np.arange(n)
    is_aged = aged(policy, batch, now)
    predicted = ~np.isnan(batch.predicted_total)
    log_left = _log_remaining(policy, batch)
    # unaged_key's classes: aged (0) by arrival, unpredicted (1) by the prior, predicted (2)
    if policy.config.prior == "prompt_length":
        prior_first, prior_second = batch.prompt_tokens, batch.arrival_time
    else:
        prior_first, prior_second = batch.arrival_time, np.zeros(n)
    kind = np.where(is_aged, 0, np.where(predicted, 2, 1))
    first = np.where(is_aged, batch.arrival_time, np.where(predicted, log_left, prior_first))
    second = np.where(is_aged, 0.0, np.where(predicted, batch.arrival_time, prior_second))
    ranked = np.lexsort((index, second, first, kind))
    victim = _victim(batch, is_aged, predicted, log_left)
    return np.concatenate((ranked[ranked != victim], [victim]))


def _victim(batch, is_aged, predicted, log_left) -> int:
    """:meth:`LeapPolicy.choose_victim`: longest predicted fresh, else last-arrived fresh."""
    index = np.arange(len(batch))
    fresh = ~is_aged
    pool = fresh & predicted
    if pool.any():
        keys = (index[pool], batch.arrival_time[pool], log_left[pool])
        return int(index[pool][np.lexsort(keys)[-1]])
    pool = fresh if fresh.any() else np.ones(len(batch), dtype=bool)
    keys = (index[pool], batch.arrival_time[pool])
    return int(index[pool][np.lexsort(keys)[-1]])


def _left_and_inflation(policy: LeapPolicy, batch: RunningBatch):
    left = expected_remaining(  # NaN (no prediction) stays NaN
        batch.predicted_total, batch.generated_tokens, batch.error_log_std, batch.max_tokens
    )
    return left, policy.config.risk_k * batch.predicted_log_std


def _log_remaining(policy: LeapPolicy, batch: RunningBatch) -> np.ndarray:
    left, inflation = _left_and_inflation(policy, batch)
    return np.log(left) + inflation
