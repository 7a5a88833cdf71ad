"""LeapScheduler: shortest-predicted-remaining first, on top of vLLM's own scheduler.

Extends ``vllm.v1.core.sched.scheduler.Scheduler`` and ``AsyncScheduler``
(vLLM 0.32.0) through one mixin; pass ``--scheduler-cls
vllm_ext.leap.scheduler.make_scheduler`` (the factory picks the async variant
when vLLM schedules asynchronously, as on GPUs). Before each
``super().schedule()`` it only rearranges vLLM's queues:

1. SRPT admission: waiting requests beyond the free decode slots are paired,
   shortest expected remaining first (its prediction, or the prior for a
   request not yet prefilled), with the running requests of longest predicted
   remaining; each runner whose remaining exceeds its partner's by
   ``preempt_margin`` is preempted (vLLM's own ``_preempt_request``; its
   prompt blocks stay in the prefix cache). Several per step, so a burst of
   new requests is probed at the batch width.
2. ``waiting`` is ordered by :class:`~vllm_ext.leap.policy.LeapPolicy`
   (aged first, then shortest expected remaining).
3. ``running`` is ordered so that the policy's preemption victim is last —
   vLLM's FCFS victim is ``running[-1]``.

With a probe lane (``probe_slots`` > 0) step 1 is
:meth:`~vllm_ext.leap.policy.LeapPolicy.plan_slots` instead: while requests
without a prediction wait, up to ``probe_slots`` slots admit them only for
their prefill (the probe); the others hold the shortest expected requests,
and a probed request that does not win one is parked again at once. The
plan's picks go to the head of ``waiting``, which vLLM admits in order.

Without information (no weights, a constant model, predictor down) nothing
is touched, the prompt-length prior included: the schedule is exactly vLLM's.
"""

from __future__ import annotations

import dataclasses
import time

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.request_queue import SchedulingPolicy
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from vllm_ext.common.log import get_logger
from vllm_ext.leap.connector import LeapConnector, leap_worker_meta
from vllm_ext.leap.policy import LeapPolicy, RequestView
from vllm_ext.leap.runtime import HINT_KEY

logger = get_logger(__name__)


def find_leap_connector(connector) -> LeapConnector | None:
    """Our connector, directly configured or inside a MultiConnector."""
    if isinstance(connector, LeapConnector):
        return connector
    for inner in getattr(connector, "_connectors", ()):
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
        self.leap_policy = self._leap_fcfs_prior  # set per step by schedule()
        # request id -> (output tokens, prediction, policy, view, remaining, unaged key):
        # what the policy derives from a request that did not change since the last step
        self._leap_views: dict[str, tuple] = {}
        self._leap_remaining: dict[str, float | None] = {}  # this step's, by request id
        self._leap_keys: dict[str, tuple] = {}  # this step's unaged sort keys
        # the lane needs a slot left for decoding
        self._leap_lane_width = min(self.leap.config.probe_slots, self.max_num_running_reqs - 1)
        logger.info(
            "LEAP scheduler active (%s predictor, %s)",
            "calibrated" if self.leap.active else "no",
            type(self).__mro__[2].__name__,
        )

    def schedule(self, *args, **kwargs):
        now = time.time()
        # the policy of this step: the configured prior only beside an informative model
        # (looked up once: it is read per request below)
        self.leap_policy = self._leap_with_prior if self.leap.informative else self._leap_fcfs_prior
        # views of unchanged requests (most of a long queue) come from the last step
        cache, self._leap_views = self._leap_views, {}
        self._leap_remaining, self._leap_keys = {}, {}
        views = {r.request_id: self._leap_view(r, cache) for r in (*self.waiting, *self.running)}
        if self._leap_lane_width and self.leap.informative:
            probes = self._leap_fill_slots(views, now)
            output = super().schedule(*args, **kwargs)
            admitted = sum(self.requests[i].status == RequestStatus.RUNNING for i in probes)
            self.leap.counters.inc("lane_probes", admitted)
            return output
        # no prediction, or one value for all (a constant predictor), and no prompt
        # prior: nothing to order by, so the schedule stays exactly vLLM's. leap_policy
        # stands the prior down without an informative model: no information, no change
        predicted = {v.predicted_total for v in views.values()} - {None}
        by_prompt = self.leap_policy.config.prior == "prompt_length" and len(self.waiting) > 1
        if len(predicted) >= 2 or by_prompt:
            self._leap_admit_shorter(views, now)
            self._leap_order_queues(views, now)
        return super().schedule(*args, **kwargs)

    def update_from_output(self, scheduler_output, model_runner_output, *args, **kwargs):
        # probes first: vLLM finishes requests before it passes the connector output on,
        # so a request ending at its first token would finish unpredicted and unlearned
        kv_output = model_runner_output.kv_connector_output
        if kv_output is not None:
            self._leap_connector.deliver_probes(
                leap_worker_meta(kv_output, self.connector), is_live=self.requests.__contains__
            )
        return super().update_from_output(scheduler_output, model_runner_output, *args, **kwargs)

    def _leap_view(self, request, cache: dict) -> RequestView:
        extra = request.sampling_params.extra_args if request.sampling_params else None
        hint = extra.get(HINT_KEY) if extra else None
        prediction = self.leap.prediction(request.request_id, hint)
        generated = request.num_output_tokens
        if prediction is None and generated > 0:
            # prefill finished on an earlier step; start the prediction timeout
            self.leap.on_scheduled_prefill_done(request.request_id)
        policy = self.leap_policy
        cached = cache.get(request.request_id)
        if cached is not None and cached[:3] == (generated, prediction, policy):
            view, remaining, key = cached[3:]
        else:
            view = RequestView(
                request_id=request.request_id,
                arrival_time=request.arrival_time,
                prompt_tokens=request.num_prompt_tokens,
                generated_tokens=generated,
                predicted_total=prediction.total_tokens if prediction else None,
                predicted_log_std=prediction.log_std if prediction else None,
            )
            remaining, key = policy.remaining(view), policy.unaged_key(view)
        self._leap_views[request.request_id] = (
            generated, prediction, policy, view, remaining, key
        )  # fmt: skip
        self._leap_remaining[request.request_id] = remaining
        self._leap_keys[request.request_id] = key
        return view

    def _leap_order_queues(self, views: dict[str, RequestView], now: float) -> None:
        waiting = {r.request_id: r for r in self.waiting}
        order = self.leap_policy.order([views[i] for i in waiting], now, self._leap_keys)
        self.waiting.clear()
        self.waiting.extend(waiting[i] for i in order)
        running = {r.request_id: r for r in self.running}
        order = self.leap_policy.order([views[i] for i in running], now, self._leap_keys)
        if order:
            # vLLM's FCFS preemption victim is running[-1]
            victim = self.leap_policy.choose_victim([views[i] for i in running], now)
            order.remove(victim)
            order.append(victim)
        self.running[:] = [running[i] for i in order]

    def _leap_fill_slots(self, views: dict[str, RequestView], now: float) -> list[str]:
        """Park runners and put the plan's picks at the head of ``waiting``; returns lane picks."""
        policy = self.leap_policy
        preempt = self.leap.config.preempt
        plan = policy.plan_slots(
            [views[r.request_id] for r in self.waiting],
            [
                (
                    views[r.request_id],
                    preempt and self._leap_preemptible(r, views[r.request_id], now),
                )
                for r in self.running
            ],
            slots=self.max_num_running_reqs,
            prior=self.leap.typical_tokens,
            lane_width=self._leap_lane_width,
            now=now,
        )
        running = {r.request_id: r for r in self.running}
        for request_id in plan.park:
            self._leap_preempt(running[request_id], now)
        self._leap_order_queues(views, now)
        # vLLM admits from the head of waiting while slots are free: the plan's picks
        head = {request_id: i for i, request_id in enumerate((*plan.admit, *plan.probe))}
        waiting = sorted(self.waiting, key=lambda r: head.get(r.request_id, len(head)))
        self.waiting.clear()
        self.waiting.extend(waiting)
        return plan.probe

    def _leap_admit_shorter(self, views: dict[str, RequestView], now: float) -> None:
        """Preempt the longest predicted runners for clearly shorter waiting requests (SRPT)."""
        config = self.leap.config
        prior = self.leap.typical_tokens  # expected length of a request not prefilled yet
        if not config.preempt or prior is None or not self.waiting:
            return
        policy = self.leap_policy
        expected = [self._leap_remaining[r.request_id] or prior for r in self.waiting]
        runners = {
            r.request_id: r
            for r in self.running
            if self._leap_preemptible(r, views[r.request_id], now)
        }
        victims = policy.preemption_victims(
            expected,
            [(i, self._leap_remaining[i]) for i in runners],
            free_slots=self.max_num_running_reqs - len(self.running),
            margin=config.preempt_margin,
        )
        for request_id in victims:
            self._leap_preempt(runners[request_id], now)

    def _leap_preempt(self, request, now: float) -> None:
        """Back to waiting through vLLM's own preemption (its full blocks stay cached)."""
        self.running.remove(request)
        self._preempt_request(request, now)
        self.leap.counters.inc("preemptions")

    def _leap_preemptible(self, request, view: RequestView, now: float) -> bool:
        # decoding requests with a prediction, not aged, not bounced too often
        return (
            request.status == RequestStatus.RUNNING
            and request.num_output_tokens > 0
            and not request.is_prefill_chunk
            and request.num_preemptions < self.leap.config.max_preemptions
            and view.predicted_total is not None
            and not self.leap_policy.is_aged(view, now)
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
