"""LEAP degrading gracefully inside a real vLLM 0.32 engine (tiny Llama, CPU, in-process).

A blocked predictor thread (a job waiting on an Event) must not stop a step:
its predictions are missing, LEAP falls back to FCFS order and counts it, and
resumes its own order once the thread caught up. The preemption token budget
stops a preemption the count bound alone would allow. Each test runs with its
mechanism off too and must then see the other outcome. The 0.34 tier runs the
same scenarios on 0.34's scheduler (``tests/vllm034/test_leap_degrade.py``).
"""

from __future__ import annotations

import threading

import pytest

from tests.engine.leap_helpers import (
    leap_connector_of,
    leap_engine_kwargs,
    record_schedule,
    run_to_completion,
    write_weights,
)
from tests.helpers import engine
from vllm_ext.leap.runtime import HINT_KEY

MODEL = "tiny-llama"
HIDDEN = 128
PROMPTS = [list(range(100 + 7 * i, 100 + 7 * i + n)) for i, n in enumerate((40, 70, 90, 13))]
# a blocked thread is released well before this; a step that waited for it would not be
GATE_TIMEOUT_S = 60.0


def _params(max_tokens, hint=None):
    from vllm import SamplingParams

    extra = {HINT_KEY: hint} if hint is not None else None
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, extra_args=extra)


def _start_order(trace) -> list[str]:
    started: list[str] = []
    for step in trace:
        started += [rid for rid, _ in step if rid not in started]
    return started


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
    with engine(MODEL, **leap_engine_kwargs(leap, max_num_seqs=1)) as llm:
        trace = record_schedule(llm)
        connector = leap_connector_of(llm)
        runtime, counters = connector.runtime, connector.counters
        assert runtime.background_predictions
        gate = threading.Event()
        blocker = runtime.predictor_thread.submit(gate.wait, GATE_TIMEOUT_S)
        engine_ = llm.llm_engine
        engine_.add_request("p0", {"prompt_token_ids": PROMPTS[0]}, _params(6))
        engine_.step()  # p0's prompt: its probe vector goes to the blocked thread
        # two hinted requests queue behind p0, the longer one first
        engine_.add_request("long", {"prompt_token_ids": PROMPTS[1]}, _params(8, hint=8))
        engine_.add_request("short", {"prompt_token_ids": PROMPTS[2]}, _params(2, hint=2))
        outputs = run_to_completion(llm)
        # every step was scheduled and ran while the thread stayed blocked
        blocked_throughout = not blocker.done()
        first_order = _start_order(trace)
        late = counters.value("late_predictions")
        fallback_steps = counters.value("fcfs_fallback_steps")
        gate.set()
        runtime.drain(GATE_TIMEOUT_S)
        engine_.add_request("p1", {"prompt_token_ids": PROMPTS[3]}, _params(6, hint=6))
        engine_.step()  # takes the thread's results: caught up, LEAP's order again
        resumed = not runtime.fcfs_fallback
        engine_.add_request("long2", {"prompt_token_ids": PROMPTS[1]}, _params(8, hint=8))
        engine_.add_request("short2", {"prompt_token_ids": PROMPTS[2]}, _params(2, hint=2))
        run_to_completion(llm)
        second_order = _start_order(trace)[3:]
    assert blocked_throughout
    assert {rid: len(out) for rid, out in outputs.items()} == {"p0": 6, "long": 8, "short": 2}
    assert late == 1
    if fallback:
        assert first_order == ["p0", "long", "short"]  # FCFS: hints ignored
        assert fallback_steps >= 1
    else:
        assert first_order == ["p0", "short", "long"]
        assert fallback_steps == 0
    assert resumed
    assert second_order == ["p1", "short2", "long2"]


@pytest.mark.parametrize(
    "budget, preempted", [(None, True), (60, False), (400, True)], ids=["none", "tight", "loose"]
)
def test_the_token_budget_stops_a_preemption_the_count_bound_allows(budget, preempted):
    leap = {"preempt_margin": 0.5, "preempt_token_budget": budget, "max_preemptions": 2}
    with engine(MODEL, **leap_engine_kwargs(leap, max_num_seqs=1)) as llm:
        solo = llm.generate([{"prompt_token_ids": PROMPTS[2]}], _params(40))[0].outputs[0]
        engine_ = llm.llm_engine
        engine_.add_request("long", {"prompt_token_ids": PROMPTS[2]}, _params(40, hint=40))
        finished = []
        for _ in range(6):
            finished += [o.request_id for o in engine_.step() if o.finished]
        engine_.add_request("short", {"prompt_token_ids": PROMPTS[3]}, _params(3, hint=3))
        outputs = run_to_completion(llm)  # finished outputs, in finishing order
        finished += list(outputs)
        counters = leap_connector_of(llm).counters
    if preempted:
        assert finished == ["short", "long"]
        assert counters.value("preemptions") == 1
        assert counters.value("preempted_tokens") > len(PROMPTS[2])  # its prompt and output
    else:
        assert finished == ["long", "short"]
        assert counters.value("preemptions") == 0
        assert counters.value("preemptions_over_budget") >= 1
    assert outputs["long"] == list(solo.token_ids)
