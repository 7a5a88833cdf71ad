"""LEAP degrading gracefully on vLLM 0.34's ``Scheduler``, stepped as vLLM's own tests do.

A blocked predictor thread (a job waiting on an Event) must not stop a step:
its predictions are missing, LEAP falls back to FCFS order and counts it, and
resumes its own order once the thread caught up. The preemption token budget
stops a preemption the count bound alone would allow. Each test runs with its
mechanism off too and must then see the other outcome.
"""

from __future__ import annotations

import threading

import pytest
from leap034_helpers import Stepper, leap_scheduler, request, write_weights

from vllm_ext.leap.scheduler import find_leap_connector

# SmolLM2-135M's hidden size: create_scheduler's model resolves to it offline
HIDDEN = 576
PROMPTS = [list(range(100 + 7 * i, 100 + 7 * i + n)) for i, n in enumerate((40, 70, 90, 13))]
GATE_TIMEOUT_S = 60.0


def _leap(scheduler):
    return find_leap_connector(scheduler.connector)


@pytest.mark.parametrize("fallback", [True, False], ids=["fallback", "no_fallback"])
def test_a_blocked_predictor_thread_schedules_fcfs_then_leap_resumes(tmp_path, fallback):
    leap = {
        "weights_path": str(write_weights(tmp_path / "w.npz", HIDDEN)),
        "predictor_thread": True,
        "online_rls": False,
        "keepup_window": 1,
        # off: never more than all of the window late, so never a fallback
        "max_late_fraction": 0.0 if fallback else 1.0,
    }
    scheduler = leap_scheduler(leap, max_num_seqs=1)
    assert scheduler.vllm_config.model_config.get_hidden_size() == HIDDEN
    connector = _leap(scheduler)
    runtime, counters = connector.runtime, connector.counters
    gate = threading.Event()
    blocker = runtime.predictor_thread.submit(gate.wait, GATE_TIMEOUT_S)
    stepper = Stepper(scheduler, probe_dim=HIDDEN)
    scheduler.add_request(request("p0", PROMPTS[0], 6))
    stepper.step()  # p0's prompt: its vector goes to the blocked thread
    # two hinted requests queue behind p0, the longer one first
    scheduler.add_request(request("long", PROMPTS[1], 8, hint=8))
    scheduler.add_request(request("short", PROMPTS[2], 2, hint=2))
    stepper.run()
    # every step was scheduled and ran while the thread stayed blocked
    assert not blocker.done()
    assert set(stepper.finished) == {"p0", "long", "short"}
    assert counters.value("late_predictions") == 1
    if fallback:
        assert stepper.started == ["p0", "long", "short"]  # FCFS: hints ignored
        assert counters.value("fcfs_fallbacks") == 1
        assert counters.value("fcfs_fallback_steps") >= 1
    else:
        assert stepper.started == ["p0", "short", "long"]
        assert counters.value("fcfs_fallback_steps") == 0
    gate.set()
    runtime.drain(GATE_TIMEOUT_S)
    scheduler.add_request(request("p1", PROMPTS[3], 6, hint=6))
    stepper.step()  # takes the thread's results: caught up, LEAP's order again
    assert not runtime.fcfs_fallback
    scheduler.add_request(request("long2", PROMPTS[1], 8, hint=8))
    scheduler.add_request(request("short2", PROMPTS[2], 2, hint=2))
    stepper.run()
    assert stepper.started[3:] == ["p1", "short2", "long2"]
    runtime.close()


@pytest.mark.parametrize(
    "budget, preempted", [(None, True), (60, False), (400, True)], ids=["none", "tight", "loose"]
)
def test_the_token_budget_stops_a_preemption_the_count_bound_allows(budget, preempted):
    leap = {"preempt_margin": 0.5, "preempt_token_budget": budget, "max_preemptions": 2}
    scheduler = leap_scheduler(leap, max_num_seqs=1)
    stepper = Stepper(scheduler)
    # as test_shorter_arrival_preempts_longest: one request first, for LEAP's prior
    scheduler.add_request(request("solo", PROMPTS[2], 40, hint=40))
    stepper.run()
    scheduler.add_request(request("long", PROMPTS[2], 40, hint=40))
    for _ in range(6):
        stepper.step()
    computed = scheduler.requests["long"].num_computed_tokens  # 90 prompt + 5 output
    scheduler.add_request(request("short", PROMPTS[3], 3, hint=3))
    stepper.run()
    counters = _leap(scheduler).counters
    if preempted:
        assert stepper.finished == ["solo", "short", "long"]
        assert counters.value("preemptions") == 1
        assert counters.value("preempted_tokens") == computed
    else:
        assert stepper.finished == ["solo", "long", "short"]
        assert counters.value("preemptions") == 0
        assert counters.value("preemptions_over_budget") >= 1
    assert stepper.outputs["long"] == [7] * 40  # every token once, none dropped
