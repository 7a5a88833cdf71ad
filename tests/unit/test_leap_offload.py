"""LEAP's predictor thread and keep-up rule (``offload``), and the runtime using them.

The thread is blocked deliberately (a job waiting on an Event) to show that the
step side never waits for it: late predictions are missing ones, counted, and
past the threshold LEAP falls back to FCFS until the thread catches up.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from vllm_ext.common.counters import Counters
from vllm_ext.leap.config import LeapConfig
from vllm_ext.leap.offload import KeepUp, PredictorThread
from vllm_ext.leap.predictor import LinearLengthModel
from vllm_ext.leap.runtime import COUNTERS, LeapRuntime

DIM = 8
# a blocked thread is released well before this; a step that waited for it would not be
GATE_TIMEOUT_S = 60.0


@pytest.fixture
def weights(tmp_path):
    rng = np.random.default_rng(0)
    X = rng.normal(size=(200, DIM))
    path = tmp_path / "w.npz"
    LinearLengthModel.fit_ridge(X, np.expm1(3.0 + X[:, 0])).save(path)
    return path


@pytest.fixture
def refine_weights(tmp_path):
    rng = np.random.default_rng(1)
    F = rng.normal(size=(300, DIM + 2))
    path = tmp_path / "refine.npz"
    LinearLengthModel.fit_ridge(F, np.expm1(4.0 + F[:, 1])).save(path)
    return path


def _runtime(weights, background: bool, **config) -> LeapRuntime:
    cfg = LeapConfig(weights_path=str(weights), **config)
    return LeapRuntime(
        cfg, Counters("leap", COUNTERS), hidden_size=DIM, background_predictor=background
    )


def _block(runtime: LeapRuntime) -> tuple[threading.Event, object]:
    gate = threading.Event()
    return gate, runtime.predictor_thread.submit(gate.wait, GATE_TIMEOUT_S)


def _vectors(rng, n: int, start: int = 0) -> dict[str, np.ndarray]:
    return {f"r{start + i}": rng.normal(size=DIM).astype(np.float32) for i in range(n)}


def test_keep_up_enters_past_the_threshold_and_leaves_once_caught_up():
    keep = KeepUp(window=4, max_late_fraction=0.5)
    for late in (True, False, True):
        keep.record(late)
    assert keep.update(backlog=3) == (False, False)  # 2 of 4: not more than half
    keep.record(True)
    assert keep.update(backlog=0) == (False, False)  # caught up already: nothing to fall back on
    assert keep.update(backlog=1) == (True, True)
    assert keep.update(backlog=1) == (True, False)
    assert keep.update(backlog=0) == (False, False)
    assert keep.late == 0  # the window starts afresh
    never = KeepUp(window=2, max_late_fraction=1.0)
    never.record(True)
    never.record(True)
    assert never.update(backlog=5) == (False, False)


def test_ready_jobs_come_back_in_order_and_a_blocked_thread_is_never_waited_for():
    thread = PredictorThread(Counters("leap", COUNTERS))
    gate = threading.Event()
    blocker = thread.submit(gate.wait, GATE_TIMEOUT_S)
    jobs = [thread.submit_job("predict", lambda i=i: i, watched=[f"r{i}"]) for i in range(3)]
    ready, late = thread.take_ready()  # the schedule right after: pending is not late yet
    assert ready == [] and late == [] and thread.backlog == 3
    ready, late = thread.take_ready()  # a whole step later: late, reported once
    assert ready == [] and late == jobs
    assert thread.take_ready() == ([], [])
    assert not blocker.done()  # take_ready returned while the thread was still blocked
    gate.set()
    thread.drain(GATE_TIMEOUT_S)
    ready, late = thread.take_ready()
    assert [job.future.result() for job in ready] == [0, 1, 2] and late == []
    assert thread.backlog == 0
    assert thread._counters.value("predictor_thread_seconds") > 0
    thread.close()


def test_background_predictions_equal_inline_ones(weights, refine_weights):
    rng = np.random.default_rng(7)
    vectors = _vectors(rng, 6)
    decode = {r: (32, rng.normal(size=DIM)) for r in vectors}
    runtimes = {}
    for background in (False, True):
        rt = _runtime(weights, background, refine_weights_path=str(refine_weights), risk_k=0.5)
        rt.on_probes(vectors)
        rt.drain()
        rt.collect_ready()
        rt.on_decode_probes(decode)
        rt.drain()
        rt.collect_ready()
        runtimes[background] = rt
    for req_id in vectors:
        inline, offloaded = runtimes[False].prediction(req_id), runtimes[True].prediction(req_id)
        assert offloaded.total_tokens == inline.total_tokens
        assert offloaded.log_std == inline.log_std
    assert runtimes[True].counters.value("refinements") == len(vectors)
    assert runtimes[True].counters.value("late_predictions") == 0


def test_a_blocked_predictor_thread_means_missing_predictions_then_fcfs_then_recovery(weights):
    rt = _runtime(weights, True, keepup_window=4, max_late_fraction=0.5)
    rng = np.random.default_rng(3)
    gate, blocker = _block(rt)
    for step in range(3):  # one request finishes its prompt per step
        rt.on_probes(_vectors(rng, 1, start=step))
        rt.collect_ready()  # the next step's schedule: nothing ready, nothing waited for
    assert rt.counters.value("late_predictions") == 2 and not rt.fcfs_fallback
    rt.collect_ready()  # r2's second schedule: late too
    assert not blocker.done()
    assert all(rt.prediction(f"r{i}") is None for i in range(3))  # missing: FCFS place
    assert rt.counters.value("late_predictions") == 3
    assert rt.fcfs_fallback and rt.counters.value("fcfs_fallbacks") == 1
    gate.set()
    rt.drain(GATE_TIMEOUT_S)
    rt.collect_ready()  # caught up: the predictions land and LEAP's order is back
    assert not rt.fcfs_fallback
    assert all(rt.prediction(f"r{i}") is not None for i in range(3))
    assert rt.counters.value("predictions") == 3


def test_a_request_finished_while_its_prediction_was_pending_leaves_nothing(weights):
    rt = _runtime(weights, True)
    gate, _ = _block(rt)
    rt.on_probes({"gone": np.ones(DIM, dtype=np.float32)})
    rt.on_finished("gone", 12, stopped=True, length_capped=False)
    gate.set()
    rt.drain(GATE_TIMEOUT_S)
    rt.collect_ready()
    assert rt.num_live() == 0 and rt.prediction("gone") is None
    assert rt.counters.value("rls_updates") == 1  # learned on the thread, after the gate


def test_step_side_seconds_are_counted_per_component(weights, refine_weights):
    rt = _runtime(weights, False, refine_weights_path=str(refine_weights))
    rt.on_probes({"r": np.zeros(DIM)})
    rt.on_decode_probes({"r": (32, np.zeros(DIM))})
    rt.on_finished("r", 40, stopped=True, length_capped=False)
    for name in ("sched_predict_seconds", "sched_refine_seconds", "sched_rls_seconds"):
        assert rt.counters.value(name) > 0, name
    assert rt.counters.value("predictor_thread_seconds") == 0  # nothing ran off the step
