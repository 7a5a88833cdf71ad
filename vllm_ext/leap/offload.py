"""LEAP's predictor work off the scheduler's step, and the rule for when it cannot keep up.

Pure Python (no vLLM). :class:`PredictorThread` runs predictions, refinements
and RLS updates on one background thread, in submission order (so the model
sees the same sequence of predictions and updates as inline). The step thread
never waits for it: :meth:`PredictorThread.take_ready` returns the jobs that
have finished, in order, and leaves the rest; a prediction that is not ready
when a step is scheduled is a missing prediction for that step.

A prediction is *late* when it is still pending at the
:data:`LATE_AFTER_SCHEDULES`-th schedule after its probe vector arrived: the
next schedule follows the vector's delivery at once (the thread may not even
have had the GIL yet), the one after it leaves a whole forward pass to run in.
:class:`KeepUp` watches, per predicted request, whether its prediction was
late. When more than ``max_late_fraction`` of the last ``window`` were late,
LEAP falls back to FCFS order; it resumes once the thread has no backlog (it
caught up).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from vllm_ext.common.counters import Counters

# schedules a prediction may miss before it counts as late (see the module doc)
LATE_AFTER_SCHEDULES = 2


@dataclass
class Job:
    """One submitted unit of predictor work and what the step thread needs to apply it."""

    kind: str  # "predict" or "refine"
    future: Future
    # ids whose timeliness counts for KeepUp (prefill predictions)
    watched: tuple[str, ...] = ()
    late: bool = False  # reported late (once) by take_ready
    polls: int = 0  # schedules that found it pending
    context: dict[str, Any] = field(default_factory=dict)


class PredictorThread:
    """One worker thread for LEAP's numeric work; results are picked up, never awaited.

    Args:
        counters: gets ``predictor_thread_seconds`` (busy time of the thread).
    """

    def __init__(self, counters: Counters):
        self._counters = counters
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="leap-predictor")
        self._jobs: deque[Job] = deque()  # prediction/refinement jobs not yet taken, in order
        self._last: Future | None = None  # the last submission of any kind (drain)

    def submit(self, fn: Callable, *args) -> Future:
        """Run ``fn(*args)`` on the thread after everything submitted before it."""
        future = self._pool.submit(self._timed, fn, *args)
        self._last = future
        return future

    def submit_job(self, kind: str, fn: Callable, *args, watched=(), **context) -> Job:
        """Like :meth:`submit`, for work whose result the step applies (:meth:`take_ready`)."""
        job = Job(kind, self.submit(fn, *args), tuple(watched), context=context)
        self._jobs.append(job)
        return job

    @property
    def backlog(self) -> int:
        """Prediction/refinement jobs submitted and not yet taken."""
        return len(self._jobs)

    def take_ready(self) -> tuple[list[Job], list[Job]]:
        """``(ready, late)``: the finished jobs from the front, in order, and the jobs
        that became late at this call (pending at their :data:`LATE_AFTER_SCHEDULES`-th
        call; each is reported once). Call once per schedule."""
        ready = []
        while self._jobs and self._jobs[0].future.done():
            ready.append(self._jobs.popleft())
        late = []
        for job in self._jobs:
            job.polls += 1
            if not job.late and job.polls >= LATE_AFTER_SCHEDULES:
                job.late = True
                late.append(job)
        return ready, late

    def drain(self, timeout: float | None = None) -> None:
        """Wait until everything submitted so far has run (tests, shutdown)."""
        if self._last is not None:
            self._last.result(timeout)

    def close(self) -> None:
        """Run what is queued, then stop the thread."""
        self._pool.shutdown(wait=True)

    def _timed(self, fn: Callable, *args):
        started = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self._counters.inc("predictor_thread_seconds", time.perf_counter() - started)


class KeepUp:
    """Whether LEAP's predictions arrive in time, over the last ``window`` requests.

    Args:
        window: how many recent predicted requests are looked at (>= 1).
        max_late_fraction: fall back to FCFS when more than this fraction of
            ``window`` were late (in [0, 1]; 1 = never).
    """

    def __init__(self, window: int, max_late_fraction: float):
        self.window = window
        self.max_late_fraction = max_late_fraction
        self._outcomes: deque[bool] = deque(maxlen=window)  # True: late
        self.fallback = False

    def record(self, late: bool) -> None:
        """One predicted request: was its prediction late at its first schedule?"""
        self._outcomes.append(late)

    @property
    def late(self) -> int:
        return sum(self._outcomes)

    def update(self, backlog: int) -> tuple[bool, bool]:
        """This step's state given the thread's ``backlog``; returns ``(fallback, entered)``.

        Enters when more than ``max_late_fraction * window`` of the recent
        requests were late; leaves (and forgets the window) once the backlog is
        empty, i.e. the thread has caught up.
        """
        entered = False
        if self.fallback:
            if backlog == 0:
                self.fallback = False
                self._outcomes.clear()
        elif self.late > math.floor(self.max_late_fraction * self.window) and backlog > 0:
            self.fallback = entered = True
        return self.fallback, entered
