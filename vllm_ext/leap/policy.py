"""LEAP serving order and preemption victim, over plain request views (no vLLM types).

Serving order (ascending :meth:`LeapPolicy.sort_key`), in three classes:

1. **aged** (waited >= ``max_wait_s``): first, FCFS among them -- the
   starvation bound;
2. **unpredicted** (no prediction yet): by arrival (prior ``fcfs``) or by
   prompt length (prior ``prompt_length``);
3. **predicted**: shortest predicted remaining first, ties by arrival.

Why unpredicted requests go *ahead of* predicted ones: the prediction comes
from the request's own prefill hidden state, so a request is unpredicted
exactly until it has been prefilled once. Ranking it behind predicted
requests would stop new requests from being probed at all (they would be
served only by aging), and the probe is work the request needs anyway.
Predicted requests then compete by length (resumption after preemption, and
victim choice). A stream of new arrivals can delay predicted requests, which
the aging class bounds. It also gives the property the adapter relies on:
with no predictions at all (predictor off, prior ``fcfs``) the order is
exactly FCFS -- aged requests all arrived before non-aged ones, so the two
arrival-sorted classes concatenate to one arrival order. Ties keep the input
order (a stable sort; keys never compare request ids), so callers pass views
in queue-insertion order.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from vllm_ext.leap.config import LeapConfig
from vllm_ext.leap.remaining import expected_remaining

_AGED, _UNPREDICTED, _PREDICTED = 0, 1, 2
# exp() overflows past this; remaining() reports inf instead of raising
MAX_LOG = 709.0


@dataclass(frozen=True, slots=True)
class RequestView:
    """What the policy sees of one request.

    Args:
        request_id: unique id.
        arrival_time: seconds on the same clock as ``now``.
        prompt_tokens: prompt length.
        generated_tokens: output tokens generated so far.
        predicted_total: predicted total output tokens (> 0), None if none yet.
        predicted_log_std: std of the prediction in log1p space (>= 0), if known.
        error_log_std: spread of the prediction's error in log1p space (>= 0) for the
            conditional remaining (:mod:`~vllm_ext.leap.remaining`); 0: taken as exact.
        max_tokens: the request's output cap (> 0; inf: none).
    """

    request_id: str
    arrival_time: float
    prompt_tokens: int
    generated_tokens: int
    predicted_total: float | None
    predicted_log_std: float | None = None
    error_log_std: float = 0.0
    max_tokens: float = math.inf

    def __post_init__(self) -> None:
        where = f"RequestView({self.request_id!r})"
        if not isinstance(self.request_id, str):
            raise ValueError(f"{where}: request_id must be a str")
        if not math.isfinite(self.arrival_time):
            raise ValueError(f"{where}: arrival_time must be finite, got {self.arrival_time}")
        for name in ("prompt_tokens", "generated_tokens"):
            value = getattr(self, name)
            if not _is_count(value):
                raise ValueError(f"{where}: {name} must be an int >= 0, got {value!r}")
        total, std = self.predicted_total, self.predicted_log_std
        if total is not None and not (math.isfinite(total) and total > 0):
            raise ValueError(f"{where}: predicted_total must be finite and > 0, got {total}")
        if std is not None and not (math.isfinite(std) and std >= 0):
            raise ValueError(f"{where}: predicted_log_std must be finite and >= 0, got {std}")
        if not (math.isfinite(self.error_log_std) and self.error_log_std >= 0):
            raise ValueError(f"{where}: error_log_std must be finite and >= 0")
        if not self.max_tokens > 0:
            raise ValueError(f"{where}: max_tokens must be > 0, got {self.max_tokens}")


@dataclass(frozen=True, slots=True)
class SlotPlan:
    """One step's changes: runners to park; waiting requests to admit first, in order.

    ``admit`` are decode picks, ``probe`` the probe lane's picks (admitted after them).
    """

    park: list[str]
    admit: list[str]
    probe: list[str]


class LeapPolicy:
    """Stateless ordering rules of LEAP; see the module docstring.

    Args:
        config: uses ``max_wait_s``, ``risk_k`` and ``prior``.
    """

    def __init__(self, config: LeapConfig):
        self.config = config

    def is_aged(self, view: RequestView, now: float) -> bool:
        """Whether ``view`` has waited at least ``max_wait_s`` at time ``now``."""
        return now - view.arrival_time >= self.config.max_wait_s

    def remaining(self, view: RequestView) -> float | None:
        """Predicted remaining output tokens, risk-inflated; None without a prediction.

        ``r = max(min(predicted_total, max_tokens) - generated, 1)`` (a request
        past its prediction counts as about to finish) when ``error_log_std``
        is 0; otherwise the mean remaining of the log-normal error given the
        tokens generated (:func:`~vllm_ext.leap.remaining.expected_remaining`).
        Then ``exp(log r + k * sigma)``
        with ``k = risk_k`` and ``sigma = predicted_log_std`` (0 if unknown).
        The inflation multiplies the *remaining* by ``e^(k sigma)``, not the
        total: requests with equal sigma share the factor, so risk_k reorders
        only where sigma differs.
        """
        if view.predicted_total is None:
            return None
        remaining, inflation = self._remaining_and_inflation(view)
        if inflation == 0:
            return remaining  # exact, no log/exp round trip
        if math.log(remaining) + inflation >= MAX_LOG:
            return math.inf
        return remaining * math.exp(inflation)

    def sort_key(self, view: RequestView, now: float) -> tuple[int, float, float]:
        """Key whose ascending order is the serving order (stable sort: ties keep input order)."""
        if self.is_aged(view, now):
            return (_AGED, view.arrival_time, 0.0)
        return self.unaged_key(view)

    def unaged_key(self, view: RequestView) -> tuple[int, float, float]:
        """:meth:`sort_key` of a request that has not aged: it does not depend on the time."""
        score = self._log_remaining(view)
        if score is not None:
            # log-domain score: same order as remaining(), never overflows
            return (_PREDICTED, score, view.arrival_time)
        if self.config.prior == "prompt_length":
            return (_UNPREDICTED, float(view.prompt_tokens), view.arrival_time)
        return (_UNPREDICTED, view.arrival_time, 0.0)

    def order(
        self, views: Iterable[RequestView], now: float, unaged_keys: dict | None = None
    ) -> list[str]:
        """Request ids in serving order.

        Args:
            views: requests in queue-insertion order (it breaks exact ties).
            now: current time, on the clock of ``arrival_time``.
            unaged_keys: :meth:`unaged_key` by request id where the caller keeps
                them (the scheduler does, across steps); computed otherwise.

        Returns:
            Ids, first to serve first.
        """
        views = _unique(views)
        known = unaged_keys or {}

        def key(view: RequestView) -> tuple[int, float, float]:
            if self.is_aged(view, now):
                return (_AGED, view.arrival_time, 0.0)
            cached = known.get(view.request_id)
            return cached if cached is not None else self.unaged_key(view)

        return [v.request_id for v in sorted(views, key=key)]

    def choose_victim(self, running_views: Iterable[RequestView], now: float) -> str:
        """Preemption victim among running requests.

        Aged requests are protected (preempting them would break the aging
        bound); if every running request is aged, the last in FCFS order goes.
        Among the non-aged: the longest predicted remaining (ties: latest
        arrival, then latest in input order). Unpredicted requests count as
        shorter than any predicted one: their probe is in flight, and
        preempting them throws away the prefill that produces it. With no
        prediction among them: the last in FCFS order, vLLM's default victim
        (the most recently arrived running request). Under prior ``fcfs`` the
        victim is therefore always the last of :meth:`order`.

        Args:
            running_views: running requests in running-queue order.
            now: current time.

        Returns:
            The victim's request id.
        """
        views = _unique(running_views)
        if not views:
            raise ValueError("choose_victim needs at least one running request")
        fresh = [i for i, v in enumerate(views) if not self.is_aged(v, now)]
        scored = [(self._log_remaining(views[i]), views[i].arrival_time, i) for i in fresh]
        predicted = [key for key in scored if key[0] is not None]
        if predicted:
            return views[max(predicted)[2]].request_id
        pool = fresh or range(len(views))
        return views[max(pool, key=lambda i: (views[i].arrival_time, i))].request_id

    def preemption_victims(
        self,
        waiting_expected: Iterable[float],
        runners: Iterable[tuple[str, float]],
        free_slots: int,
        margin: float,
        movable: Callable[[str], bool] | None = None,
    ) -> list[str]:
        """Running requests to preempt this step so shorter waiting ones can run (SRPT).

        Pairs the shortest expected waiting requests with the longest running
        ones: a runner goes when its remaining exceeds its waiting partner's
        expected remaining by ``margin`` (a fraction). Waiting requests that
        ``free_slots`` will admit anyway need no victim. Several victims per
        step let LEAP probe a burst of new requests at the batch width instead
        of one per step: a probed request that turns out long is parked again
        at once, and its prompt blocks stay in vLLM's prefix cache.

        Args:
            waiting_expected: expected remaining tokens of each waiting request
                (its prediction, or the prior for one not prefilled yet).
            runners: ``(request_id, remaining)`` of each preemptible runner.
            free_slots: decode slots free before any preemption.
            margin: minimum relative advantage, ``>= 0``.
            movable: whether a runner may be preempted; asked only for the
                runners the pairing reaches, longest first (a runner it rejects
                is skipped, as if it were not in ``runners``).

        Returns:
            Victim ids, longest remaining first.
        """
        waiting = iter(sorted(waiting_expected)[max(free_slots, 0) :])
        longest = sorted(runners, key=lambda r: r[1], reverse=True)
        victims = []
        expected = next(waiting, None)
        for request_id, remaining in longest:
            if expected is None or remaining <= expected * (1 + margin):
                break
            if movable is None or movable(request_id):
                victims.append(request_id)
                expected = next(waiting, None)
        return victims

    def plan_slots(
        self,
        waiting: Iterable[RequestView],
        runners: Iterable[tuple[RequestView, bool]],
        slots: int,
        prior: float,
        lane_width: int,
        now: float,
    ) -> SlotPlan:
        """Decode slots shortest-expected-first, plus a probe lane for unprobed requests.

        A request's prediction exists only after its own prefill, so without a
        lane LEAP must admit a queued request to a decode slot (on the prior)
        to learn its length. The lane admits up to ``lane_width`` more unprobed
        waiting requests (the next in prior order) for their prefill; once
        probed, such a request competes like any other and is parked again
        when it does not win a decode slot. Its blocks stay in vLLM's prefix
        cache, so a resume recomputes only the last partial block.

        Decode slots (``slots`` minus pinned runners minus the lane) go to the
        lowest keys: aged waiting requests first (arrival order), then the
        log of expected remaining tokens -- from its prediction, or from
        ``prior`` for an unprobed request outside the lane. A movable
        runner's key is lowered by ``log(1 + preempt_margin)``, so it is
        parked only for a clearly shorter request (no churn on near ties); on
        exact ties runners stay.

        Args:
            waiting: waiting requests, queue order.
            runners: ``(view, movable)`` per running request; a pinned runner
                (not movable) keeps its slot, and one without a prediction
                is counted as using the lane.
            slots: the most requests that may run (vLLM's ``max_num_seqs``).
            prior: typical total tokens of an unprobed request (> 0); it is scored
                as a request predicted at ``prior`` (so capped at its max_tokens,
                and under ``remaining=conditional`` a mean given its spread).
            lane_width: slots the lane may use (0: no lane).
            now: current time, on the clock of ``arrival_time``.

        Returns:
            The runners to park, the decode picks and the lane picks.
        """
        waiting, runners = _unique(waiting), list(runners)
        pinned = [v for v, movable in runners if not movable]
        unprobed = [v for v in waiting if v.predicted_total is None and not self.is_aged(v, now)]
        unprobed = sorted(unprobed, key=lambda v: self.sort_key(v, now))
        in_lane = sum(v.predicted_total is None for v in pinned)
        free = max(slots - len(pinned), 0)
        lane_size = min(max(lane_width - in_lane, 0), len(unprobed), free)
        prior_rank = {v.request_id: i for i, v in enumerate(unprobed)}
        stay_bias = math.log1p(self.config.preempt_margin)

        def key(view: RequestView, running: bool) -> tuple:
            # (aged first, log expected remaining, runners before waiting, prior order, arrival)
            if not running and self.is_aged(view, now):
                return (0, 0.0, 0, 0, view.arrival_time)
            score = self._log_remaining(view)
            if score is None:
                score = math.log(self._remaining_at(max(prior, 1.0), view))
            elif running:
                score -= stay_bias
            rank = prior_rank.get(view.request_id, len(unprobed))
            return (1, score, 0 if running else 1, rank, view.arrival_time)

        candidates = [(key(v, True), v, True) for v, movable in runners if movable]
        candidates += [(key(v, False), v, False) for v in waiting]
        candidates.sort(key=lambda c: c[0])
        chosen = candidates[: free - lane_size]
        picked = {v.request_id for _, v, _ in chosen}
        # the lane probes the next unprobed requests in prior order; slots it leaves
        # unused (too few unprobed) go to the next candidates
        lane = [v for v in unprobed if v.request_id not in picked][:lane_size]
        lane_ids = {v.request_id for v in lane}
        rest = [c for c in candidates[len(chosen) :] if c[1].request_id not in lane_ids]
        chosen += rest[: free - len(chosen) - len(lane)]
        kept = {v.request_id for _, v, running in chosen if running}
        return SlotPlan(
            park=[v.request_id for v, movable in runners if movable and v.request_id not in kept],
            admit=[v.request_id for _, v, running in chosen if not running],
            probe=[v.request_id for v in lane],
        )

    def _remaining_and_inflation(self, view: RequestView) -> tuple[float, float]:
        remaining = self._remaining_at(view.predicted_total, view)
        return remaining, self.config.risk_k * (view.predicted_log_std or 0.0)

    @staticmethod
    def _remaining_at(total: float, view: RequestView) -> float:
        """Remaining tokens of ``view`` if ``total`` were its predicted total (no risk term)."""
        generated = view.generated_tokens
        if view.error_log_std > 0:
            spread, cap = view.error_log_std, view.max_tokens
            return float(expected_remaining(total, generated, spread, cap))
        return max(min(total, view.max_tokens) - generated, 1.0)

    def _log_remaining(self, view: RequestView) -> float | None:
        """log of :meth:`remaining`: the same order, and it never overflows."""
        if view.predicted_total is None:
            return None
        remaining, inflation = self._remaining_and_inflation(view)
        return math.log(remaining) + inflation


def _is_count(value) -> bool:
    # plain ints first: the scheduler builds a view per request per step, and the
    # numbers.Integral check (for numpy ints) is an ABC lookup
    if type(value) is int:
        return value >= 0
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 0


def _unique(views: Iterable[RequestView]) -> list[RequestView]:
    views = list(views)
    ids = {v.request_id for v in views}
    if len(ids) != len(views):
        raise ValueError("duplicate request ids in views")
    return views
