"""LeapScheduler: shortest-predicted-remaining first, on top of vLLM's own scheduler.

Extends ``vllm.v1.core.sched.scheduler.Scheduler`` and ``AsyncScheduler``
(vLLM 0.32.0) through one mixin; pass ``--scheduler-cls
vllm_ext.leap.scheduler.make_scheduler`` (the factory picks the async variant
when vLLM schedules asynchronously, as on GPUs). LEAP only rearranges vLLM's
queues, at a cost per *change*, not per queued request:

- ``waiting`` is a :class:`~vllm_ext.leap.request_queue.LeapRequestQueue`:
  vLLM's own queue interface kept in :class:`~vllm_ext.leap.policy.LeapPolicy`
  order (aged first, then shortest expected remaining). A request is keyed
  when vLLM enqueues it and again only when its prediction changes.
- ``running`` changes every step (one token each), so its order comes from
  numpy over the batch (:mod:`~vllm_ext.leap.running_order`).

Before each ``super().schedule()``:

0. Loops: each time a running request's output passes a multiple of
   ``loop_check_every`` tokens, its tail is checked for a repeated token cycle
   (:mod:`~vllm_ext.leap.loops`); one that repeats (greedy, no repetition
   penalties) is predicted exactly to run to its max_tokens. A step that
   writes several tokens (speculative decoding) cannot jump past a check.
1. SRPT admission: waiting requests beyond the free decode slots are paired,
   shortest expected remaining first (its prediction, or for a request not
   yet prefilled the prior, capped at its max_tokens), with the running
   requests of longest predicted remaining; each runner whose remaining
   exceeds its partner's by ``preempt_margin`` is preempted (vLLM's own
   ``_preempt_request``; its prompt blocks stay in the prefix cache). Several
   per step, so a burst of new requests is probed at the batch width.
2. ``running`` is ordered so that the policy's preemption victim is last —
   vLLM's FCFS victim is ``running[-1]``.

With a probe lane (``probe_slots`` > 0) step 1 is
:meth:`~vllm_ext.leap.policy.LeapPolicy.plan_slots` instead: while requests
without a prediction wait, up to ``probe_slots`` slots admit them only for
their prefill (the probe); the others hold the shortest expected requests,
and a probed request that does not win one is parked again at once. The
plan's picks go to the head of ``waiting``, which vLLM admits in order.

LEAP's preemptions are bounded by count (``max_preemptions`` per request) and,
with ``preempt_token_budget``, by what they may make vLLM recompute over the
last ``preempt_budget_window`` steps (each victim at its computed tokens).

Each step first takes what LEAP's predictor thread has finished
(``predictor_thread``; never waiting for the rest). While predictions lag
(:attr:`~vllm_ext.leap.runtime.LeapRuntime.fcfs_fallback`) none of the above
runs: ``waiting`` is in arrival order and vLLM schedules FCFS until they catch up.
LEAP's own time before ``super().schedule()`` is counted in ``sched_order_seconds``.

Without information (no weights, a constant model, predictor down) nothing
is touched, the prompt-length prior included: every waiting request has one
key and aging is off, so the queue is vLLM's FIFO deque exactly, and the
schedule is exactly vLLM's.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import time

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector
from vllm.sampling_params import SamplingType
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.request_queue import SchedulingPolicy
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from vllm_ext.common.log import get_logger
from vllm_ext.leap import running_order
from vllm_ext.leap.connector import LeapConnector, leap_worker_meta
from vllm_ext.leap.loops import loop_period
from vllm_ext.leap.policy import LeapPolicy, RequestView
from vllm_ext.leap.request_queue import LeapRequestQueue
from vllm_ext.leap.running_order import RunningBatch
from vllm_ext.leap.runtime import HINT_KEY

logger = get_logger(__name__)


def find_leap_connector(connector) -> LeapConnector | None:
    """Our connector, directly configured or inside a MultiConnector."""
    if isinstance(connector, LeapConnector):
        return connector
    for inner in connector.sub_connectors if isinstance(connector, MultiConnector) else ():
        if isinstance(inner, LeapConnector):
            return inner
    return None


class LeapSchedulerMixin:
    """All LEAP logic; combined with Scheduler or AsyncScheduler below."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        leap = find_leap_connector(self.connector)
        if leap is None:
            raise ValueError(
                "LeapScheduler needs the LeapConnector: add --kv-transfer-config "
                '\'{"kv_connector": "LeapConnector", "kv_connector_module_path": '
                '"vllm_ext.leap.connector", "kv_role": "kv_both"}\' (or use '
                "vllm-ext serve --plugins leap)"
            )
        if self.policy != SchedulingPolicy.FCFS:
            raise ValueError("LeapScheduler replaces the queue order; use --scheduling-policy fcfs")
        self._leap_connector = leap
        self.leap = leap.runtime
        self._leap_with_prior = LeapPolicy(self.leap.config)
        # without an informative model the prior stands down to arrival order
        self._leap_fcfs_prior = LeapPolicy(dataclasses.replace(self.leap.config, prior="fcfs"))
        # the policy of this step, and whether the queues follow it at all (set by schedule)
        self.leap_policy = self._leap_fcfs_prior
        self._leap_keyed = False
        self._leap_in_fallback = False
        # the preemption budget: steps counted by schedule, (step, tokens) per preemption
        self._leap_step = 0
        self._leap_spent: collections.deque[tuple[int, int]] = collections.deque()
        # running batch columns of requests with a prediction, until it changes
        self._leap_columns: dict[str, tuple[float, float, float, float]] = {}
        # output length at which a running request's next loop check is due
        self._leap_loop_due: dict[str, float] = {}
        # vLLM's waiting queues, kept in LEAP's order as requests come and go (empty
        # here): ``waiting``; ``kv_holding_waiting`` (requests holding KV blocks,
        # drained first); on vLLM 0.34 ``async_kv_waiting`` (requests that may load KV
        # asynchronously, under --max-num-inflight-kv-loads), whose head vLLM weighs
        # against waiting's in _next_waiting_queue (overridden below)
        self.waiting = LeapRequestQueue(self._leap_describe)
        self.kv_holding_waiting = LeapRequestQueue(self._leap_describe)
        if hasattr(self, "async_kv_waiting"):
            self.async_kv_waiting = LeapRequestQueue(self._leap_describe)
        # the lane needs a slot left for decoding; slots are what vLLM admits into
        # RUNNING (--max-num-active-seqs, if set below --max-num-seqs)
        self._leap_lane_width = min(self.leap.config.probe_slots, self.max_num_active_reqs - 1)
        logger.info(
            "LEAP scheduler active (%s predictor, %s)",
            "calibrated" if self.leap.active else "no",
            type(self).__mro__[2].__name__,
        )

    def _leap_queues(self) -> list[LeapRequestQueue]:
        """Every waiting queue this vLLM has (the ones ``__init__`` replaced)."""
        queues = [self.waiting, self.kv_holding_waiting, getattr(self, "async_kv_waiting", None)]
        return [queue for queue in queues if isinstance(queue, LeapRequestQueue)]

    def _next_waiting_queue(self, take_async_kv: bool):
        """vLLM 0.34: ``waiting`` or ``async_kv_waiting``, whichever head LEAP serves first.

        vLLM's own merges the heads by arrival (FCFS), which would undo LEAP's
        order between the two queues; ties still go to ``waiting`` as in vLLM.
        """
        async_kv = self.async_kv_waiting
        if not take_async_kv or not async_kv:
            return self.waiting
        if not self.waiting:
            return async_kv
        if not isinstance(async_kv, LeapRequestQueue) or not isinstance(
            self.waiting, LeapRequestQueue
        ):
            return super()._next_waiting_queue(take_async_kv)
        return async_kv if async_kv.head_rank() < self.waiting.head_rank() else self.waiting

    def schedule(self, *args, **kwargs):
        # the predictor thread's finished work; what is not ready stays missing this step
        self.leap.collect_ready()
        started = time.perf_counter()
        self._leap_step += 1
        probes = self._leap_prepare(time.time())
        self.leap.counters.inc("sched_order_seconds", time.perf_counter() - started)
        output = super().schedule(*args, **kwargs)
        if probes is not None:
            admitted = sum(self.requests[i].status == RequestStatus.RUNNING for i in probes)
            self.leap.counters.inc("lane_probes", admitted)
        self.leap.counters.set("queue_length", len(self.waiting), "waiting")
        self.leap.counters.set("queue_length", len(self.running), "running")
        return output

    def _leap_prepare(self, now: float) -> list[str] | None:
        """Queues and running batch in LEAP's order for this step; the probe lane's
        picks when the lane planned the step, else None."""
        queues = self._leap_queues()
        for queue in queues:
            queue.now = now
        self._leap_update_waiting()
        if self.leap.fcfs_fallback:
            self.leap.counters.inc("fcfs_fallback_steps")
            for queue in queues:
                queue.set_head(())
            return None  # vLLM's FCFS: no reordering, no preemption, no lane
        running = self._leap_running_batch()
        if self._leap_find_loops(running):  # new predictions: pick them up
            self._leap_update_waiting()
            running = self._leap_running_batch()
        if self._leap_lane_width and self.leap.informative:
            return self._leap_fill_slots(running, now)
        for queue in queues:
            queue.set_head(())
        # without information (no prediction, or one value for all: a constant
        # predictor) and no prompt prior, the schedule stays exactly vLLM's
        if self._leap_keyed:
            running = self._leap_admit_shorter(running, now)
            self._leap_order_running(running, now)
        return None

    def update_from_output(self, scheduler_output, model_runner_output, *args, **kwargs):
        # probes first: vLLM finishes requests before it passes the connector output on,
        # so a request ending at its first token would finish unpredicted and unlearned
        kv_output = model_runner_output.kv_connector_output
        if kv_output is not None:
            self._leap_connector.deliver_probes(
                leap_worker_meta(kv_output, self.connector), is_live=self.requests.__contains__
            )
        return super().update_from_output(scheduler_output, model_runner_output, *args, **kwargs)

    # --- repetition loops: a running request's output tail read every few tokens

    def _leap_find_loops(self, batch: RunningBatch) -> bool:
        """Tell the runtime which running requests repeat a token cycle (see ``loops``);
        True if any was found."""
        config, leap = self.leap.config, self.leap
        if config.loops == "off" or not leap.active:
            return False
        every, min_span, due_at = config.loop_check_every, config.loop_min_span, self._leap_loop_due
        first = (min_span // every + 1) * every  # the first multiple past the span
        # numpy over the batch: only the requests due a check cost Python. Due once
        # the output passes the next multiple, however many tokens the last step wrote.
        next_check = [due_at.get(request.request_id, first) for request in self.running]
        due = batch.generated_tokens >= np.array(next_check, dtype=np.float64)
        found = False
        for row in np.flatnonzero(due).tolist():
            request = self.running[row]
            request_id = request.request_id
            if leap.is_exact(request_id) or not _loop_prone(request, config.loops):
                due_at[request_id] = math.inf  # nothing a check could change, ever
                continue
            due_at[request_id] = (request.num_output_tokens // every + 1) * every
            if not leap.watches_loops(request_id):
                continue
            if loop_period(request.output_token_ids, config.loop_max_period, min_span):
                leap.on_loop(request_id, request.max_tokens)
                found = True
        return found

    # --- the waiting queue: keyed once per request, re-keyed when its prediction changes

    def _leap_update_waiting(self) -> None:
        """This step's policy; re-key queued requests whose prediction or policy changed."""
        leap = self.leap
        fallback = leap.fcfs_fallback
        # the configured prior only beside an informative model: no information, no change
        policy = self._leap_with_prior if leap.informative else self._leap_fcfs_prior
        keyed = leap.distinct_predictions >= 2 or policy.config.prior == "prompt_length"
        if fallback:  # predictions lag: vLLM's order until they catch up
            policy, keyed = self._leap_fcfs_prior, False
        entering = fallback and not self._leap_in_fallback
        self._leap_in_fallback = fallback
        changed = leap.take_changed()
        # vLLM's finished_req_ids: finished or aborted since the last step
        for request_id in (*changed, *self.finished_req_ids):
            self._leap_columns.pop(request_id, None)
        for request_id in self.finished_req_ids:
            self._leap_loop_due.pop(request_id, None)
        queues = self._leap_queues()
        if entering:
            # FCFS from here: waiting by arrival, running as admitted by arrival, so
            # that vLLM's own victim (running[-1]) is the last to arrive
            self.leap_policy, self._leap_keyed = policy, keyed
            for queue in queues:
                queue.rebuild(math.inf, by_arrival=True)
            self.running.sort(key=lambda request: request.arrival_time)
            return
        if (policy, keyed) != (self.leap_policy, self._leap_keyed):
            self.leap_policy, self._leap_keyed = policy, keyed
            for queue in queues:
                queue.rebuild(policy.config.max_wait_s if keyed else math.inf)
            return
        for request_id in changed:
            for queue in queues:
                if request_id in queue:
                    queue.rekey(self.requests[request_id])

    def _leap_describe(self, request) -> tuple[tuple, float | None, RequestView]:
        """Queue key, predicted remaining and view of a waiting request."""
        hint = _hint(request)
        prediction = self.leap.prediction(request.request_id, hint)
        view = RequestView(
            request_id=request.request_id,
            arrival_time=request.arrival_time,
            prompt_tokens=request.num_prompt_tokens,
            generated_tokens=request.num_output_tokens,
            predicted_total=prediction.total_tokens if prediction else None,
            predicted_log_std=prediction.log_std if prediction else None,
            error_log_std=self._leap_spread(request.request_id, hint),
            max_tokens=request.max_tokens,
        )
        policy = self.leap_policy
        key = policy.unaged_key(view) if self._leap_keyed else _FIFO
        return key, policy.remaining(view), view

    # --- the running batch: every request changes each step, so columns, not views

    def _leap_running_batch(self) -> RunningBatch:
        columns = self._leap_columns
        rows = []
        for request in self.running:
            row = columns.get(request.request_id)
            if row is None:
                row = self._leap_columns_of(request)
            rows.append(row)
        table = np.array(rows, dtype=np.float64).reshape(len(rows), 6)
        return RunningBatch(
            table[:, 0],
            table[:, 1],
            np.array([r.num_output_tokens for r in self.running], dtype=np.float64),
            table[:, 2],
            table[:, 3],
            table[:, 4],
            table[:, 5],
        )

    def _leap_columns_of(self, request) -> tuple[float, ...]:
        """(arrival, prompt tokens, predicted total or NaN, log-std or 0, error spread,
        max_tokens); kept while predicted."""
        hint = _hint(request)
        prediction = self.leap.prediction(request.request_id, hint)
        if prediction is None:
            row = (request.arrival_time, request.num_prompt_tokens, math.nan, 0.0, 0.0, math.inf)
            if self.leap.model is None:  # nothing will come but a change: keep the row
                self._leap_columns[request.request_id] = row
            elif request.num_output_tokens > 0:
                # prefill finished on an earlier step; start the prediction timeout
                # (asked again each step until the prediction or the timeout comes)
                self.leap.on_scheduled_prefill_done(request.request_id)
            return row
        row = (
            request.arrival_time,
            request.num_prompt_tokens,
            prediction.total_tokens,
            prediction.log_std or 0.0,
            self._leap_spread(request.request_id, hint),
            request.max_tokens,
        )
        # until the runtime reports a change of this prediction (take_changed)
        self._leap_columns[request.request_id] = row
        return row

    def _leap_spread(self, request_id: str, hint) -> float:
        """Error spread of a request's prediction: a client's length hint, or the cap of
        a request caught in a loop, is exact."""
        if hint is not None or self.leap.is_exact(request_id):
            return 0.0
        return self.leap.error_log_std

    def _leap_order_running(self, batch: RunningBatch, now: float) -> None:
        """Serving order, the policy's preemption victim last (vLLM preempts ``running[-1]``)."""
        if len(self.running) < 2:
            return
        order = running_order.order(self.leap_policy, batch, now)
        self.running[:] = [self.running[i] for i in order.tolist()]

    def _leap_admit_shorter(self, batch: RunningBatch, now: float) -> RunningBatch:
        """Preempt the longest predicted runners for clearly shorter waiting requests (SRPT).

        Returns the running batch that is left.
        """
        config = self.leap.config
        if not config.preempt or not self.waiting:
            return batch
        known, unknown_caps = self.waiting.lengths()
        # requests not prefilled yet: the typical length, capped at each one's max_tokens
        prior = self.leap.prior_remaining(unknown_caps)
        if prior is None:
            return batch
        expected = [*known, *prior.tolist()]  # two sorted runs: sorting them is a merge
        remaining = running_order.remaining(self.leap_policy, batch)
        rows = np.flatnonzero(self._leap_fresh_predicted(batch, now)).tolist()
        budget = self._leap_budget()
        # the per-request checks only for the runners the pairing reaches (a few per step)
        victims = self.leap_policy.preemption_victims(
            expected,
            zip(rows, remaining[rows].tolist(), strict=True),
            free_slots=self.max_num_active_reqs - len(self.running),
            margin=config.preempt_margin,
            movable=lambda row: (
                self._leap_movable(self.running[row]) and budget.take(self.running[row])
            ),
        )
        return self._leap_preempt_rows(batch, victims, now)

    def _leap_fill_slots(self, batch: RunningBatch, now: float) -> list[str]:
        """Park runners and put the plan's picks at the head of ``waiting``; returns lane picks."""
        policy = self.leap_policy
        fresh = self._leap_fresh_predicted(batch, now).tolist()
        preempt = self.leap.config.preempt
        runners = [
            (_view(request, batch, i), preempt and fresh[i] and self._leap_movable(request))
            for i, request in enumerate(self.running)
        ]
        # the requests that wait for a slot: waiting's and (0.34) async_kv_waiting's;
        # kv_holding_waiting's are admitted first whatever the plan
        queues = [q for q in self._leap_queues() if q is not self.kv_holding_waiting]
        plan = policy.plan_slots(
            [payload for queue in queues for payload in queue.payloads()],
            runners,
            slots=self.max_num_active_reqs,
            prior=self.leap.typical_tokens,
            lane_width=self._leap_lane_width,
            now=now,
        )
        parked, budget = set(plan.park), self._leap_budget()
        rows = [i for i, r in enumerate(self.running) if r.request_id in parked and budget.take(r)]
        self._leap_order_running(self._leap_preempt_rows(batch, rows, now), now)
        # vLLM admits from the head of waiting while slots are free: the plan's picks
        # (each queue serves those it holds first; _next_waiting_queue keeps their order)
        picks = [self.requests[i] for i in (*plan.admit, *plan.probe)]
        for queue in self._leap_queues():
            queue.set_head(picks)
        return plan.probe

    def _leap_preempt_rows(self, batch: RunningBatch, rows, now: float) -> RunningBatch:
        """Preempt these running rows; returns the batch of those left running.

        Back to waiting through vLLM's own preemption (their full blocks stay cached).
        """
        if not rows:
            return batch
        gone = set(rows)
        victims = [self.running[i] for i in rows]
        # one pass, not a list.remove per victim (a scan of the whole batch each)
        self.running[:] = [r for i, r in enumerate(self.running) if i not in gone]
        tokens = sum(_recompute_tokens(request) for request in victims)
        for request in victims:
            # as vLLM's own preemption: in-flight output is dropped only where a
            # connector must hand off the KV that the preemption frees
            self._preempt_request(request, now, drop_stale_output=self.requires_kv_delivery)
        self.leap.counters.inc("preemptions", len(rows))
        self.leap.counters.inc("preempted_tokens", tokens)
        self._leap_spent.append((self._leap_step, tokens))
        return batch.without(rows)

    def _leap_budget(self) -> _PreemptionBudget:
        """What this step's preemptions may still cost (``preempt_token_budget``)."""
        config = self.leap.config
        spent = self._leap_spent
        while spent and spent[0][0] <= self._leap_step - config.preempt_budget_window:
            spent.popleft()
        if config.preempt_token_budget is None:
            return _PreemptionBudget(math.inf, self.leap.counters)
        left = config.preempt_token_budget - sum(tokens for _, tokens in spent)
        return _PreemptionBudget(left, self.leap.counters)

    # preemptible: a decoding request with a prediction, not aged, not bounced too often

    def _leap_fresh_predicted(self, batch: RunningBatch, now: float) -> np.ndarray:
        """Rows with a prediction that have not aged (the vectorised half of preemptible)."""
        fresh = ~running_order.aged(self.leap_policy, batch, now)
        return fresh & ~np.isnan(batch.predicted_total)

    def _leap_movable(self, request) -> bool:
        """The per-request half of preemptible: decoding, not bounced too often."""
        return (
            request.status == RequestStatus.RUNNING
            and request.num_output_tokens > 0
            and not request.is_prefill_chunk
            and request.num_preemptions < self.leap.config.max_preemptions
        )


# the key of every waiting request while LEAP leaves vLLM's order alone: a FIFO deque
_FIFO = ()


def _recompute_tokens(request) -> int:
    """What preempting ``request`` may cost: every computed token (prompt and output), its
    recompute when none of its blocks stays in the prefix cache."""
    return request.num_computed_tokens


class _PreemptionBudget:
    """Recompute tokens this step's preemptions may still cost; a victim over it is kept."""

    def __init__(self, left: float, counters):
        self.left = left
        self._counters = counters

    def take(self, request) -> bool:
        cost = _recompute_tokens(request)
        if cost > self.left:
            self._counters.inc("preemptions_over_budget")
            return False
        self.left -= cost
        return True


def _hint(request):
    """The client's length hint (vLLM extra_args), if any."""
    extra = request.sampling_params.extra_args if request.sampling_params else None
    return extra.get(HINT_KEY) if extra else None


def _loop_prone(request, mode: str) -> bool:
    """Whether a token cycle in ``request``'s output persists: under greedy decoding
    without repetition penalties (``loops="greedy"``), or always (``"all"``)."""
    if mode == "all":
        return True
    params = request.sampling_params
    return (
        params is not None
        and params.sampling_type == SamplingType.GREEDY
        and params.repetition_penalty == 1.0
        and not params.frequency_penalty
        and not params.presence_penalty
    )


def _view(request, batch: RunningBatch, i: int) -> RequestView:
    total, log_std = float(batch.predicted_total[i]), float(batch.predicted_log_std[i])
    predicted = not math.isnan(total)
    return RequestView(
        request_id=request.request_id,
        arrival_time=request.arrival_time,
        prompt_tokens=request.num_prompt_tokens,
        generated_tokens=request.num_output_tokens,
        predicted_total=total if predicted else None,
        predicted_log_std=log_std if predicted else None,
        error_log_std=float(batch.error_log_std[i]),
        max_tokens=float(batch.max_tokens[i]),
    )


class LeapScheduler(LeapSchedulerMixin, Scheduler):
    """LEAP over vLLM's synchronous scheduler (CPU platform, async scheduling off)."""


class LeapAsyncScheduler(LeapSchedulerMixin, AsyncScheduler):
    """LEAP over vLLM's asynchronous scheduler (GPU default)."""


def make_scheduler(*args, **kwargs):
    """``--scheduler-cls`` factory: the variant matching vLLM's async-scheduling setting."""
    vllm_config = kwargs.get("vllm_config") or args[0]
    async_scheduling = vllm_config.scheduler_config.async_scheduling
    return (LeapAsyncScheduler if async_scheduling else LeapScheduler)(*args, **kwargs)
