"""The LEAP replay's token-step engine: hand-computed schedules and its exact-prediction limits."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from benchmarks.leap.replay import METRIC_S, VARIANTS, Burst, Engine, Rules, replay

ONE_SLOT = Engine(slots=1, step_s=1.0, prefill_s_per_token=0.0)


def _burst(lengths, predicted=None, prompts=None, max_tokens=512):
    lengths = np.asarray(lengths, dtype=float)
    predicted = lengths if predicted is None else np.asarray(predicted, dtype=float)
    prompts = np.full(len(lengths), 10) if prompts is None else np.asarray(prompts)
    return Burst(lengths, predicted, prompts, max_tokens)


def test_one_slot_schedules_by_hand():
    burst = _burst([3, 1])
    # FCFS: r0 ends at step 3, r1 at step 4 -> mean(3/3, 4/1)
    assert replay(burst, VARIANTS["fcfs"], ONE_SLOT, 10.0, 0.5)[METRIC_S] == 2.5
    # the oracle runs the short one first: mean(4/3, 1/1)
    assert replay(burst, VARIANTS["oracle"], ONE_SLOT, 10.0, 0.5)[METRIC_S] == pytest.approx(7 / 6)


def test_leap_probes_then_parks_the_long_runner_for_the_unprobed_one():
    # r0 (shorter prompt, admitted first on the prompt prior) is predicted 50 tokens: above
    # the prior of 10, so it is parked after its probe step and r1 (3 tokens) runs
    burst = _burst([50, 3], prompts=[5, 20])
    run = replay(burst, VARIANTS["leap"], ONE_SLOT, 10.0, 0.5)
    assert run["parks"] == 1
    # r1 ends at step 1 + 3, r0 resumes and ends at step 4 + 49 (resume costs nothing here)
    assert run[METRIC_S] == pytest.approx(np.mean([53 / 50, 4 / 3]))
    # with a prior above r0's remaining, r0 keeps its slot
    assert replay(burst, VARIANTS["leap"], ONE_SLOT, 100.0, 0.5)["parks"] == 0


def test_the_conditional_prior_is_capped_at_max_tokens_unless_the_rules_say_not():
    # spread 0.5, cap 60: r0 (45 predicted, 1 written) has 42.9 left; the prior (40) is
    # 40.6 capped at 60 -> r0 is parked; uncapped it is 45.5 -> r0 keeps its slot
    burst = _burst([45, 3], prompts=[5, 20], max_tokens=60)
    capped = replay(burst, Rules(remaining="conditional"), ONE_SLOT, 40.0, 0.5)
    uncapped = Rules(remaining="conditional", capped_prior=False)
    assert capped["parks"] == 1
    assert replay(burst, uncapped, ONE_SLOT, 40.0, 0.5)["parks"] == 0


def test_with_exact_predictions_upfront_is_the_oracle_and_leap_never_beats_it():
    rng = np.random.default_rng(0)
    engine = Engine(slots=4, step_s=0.05, prefill_s_per_token=1e-4)
    for _ in range(5):
        lengths = rng.integers(1, 200, size=16).astype(float)
        burst = _burst(lengths, prompts=rng.integers(5, 300, size=16))
        oracle = replay(burst, VARIANTS["oracle"], engine, 60.0, 0.5)[METRIC_S]
        exact_upfront = Rules(known_upfront=True, exact=True)
        assert replay(burst, exact_upfront, engine, 60.0, 0.5)[METRIC_S] == oracle
        for name in ("leap", "leap_cond", "fcfs"):
            assert replay(burst, VARIANTS[name], engine, 60.0, 0.5)[METRIC_S] >= oracle * 0.999


def test_the_probe_lane_probes_the_queue_while_the_short_one_decodes():
    # two slots, lane width 1, prior 10: step 1 admits r0 (shortest prompt) to decode and
    # probes r1 in the lane; step 2 both are known long (39 left), r2 (prior 10) takes a
    # slot and the probed r1 is parked; r2 ends at step 3, r0 at 40, r1 resumes: 42
    engine = Engine(slots=2, step_s=1.0, prefill_s_per_token=0.0)
    burst = _burst([40, 40, 2], prompts=[5, 6, 7])
    lane = replay(burst, VARIANTS["leap_lane"], engine, 10.0, 0.5)
    assert lane["parks"] == 1
    assert lane[METRIC_S] == pytest.approx(np.mean([40 / 40, 42 / 40, 3 / 2]))


def test_a_runner_seen_looping_counts_as_running_to_its_cap():
    # r0 (admitted first) is predicted 5 but loops from the start: seen after 4 tokens,
    # it has 46 of its cap of 50 left, more than the prior of 10: parked for r1 (3)
    burst = _burst([50, 3], predicted=[5, 3], prompts=[5, 20], max_tokens=50)
    burst = replace(burst, loop_onset=np.array([4, np.inf]))
    blind = replay(burst, VARIANTS["leap_no_loops"], ONE_SLOT, 10.0, 0.5)
    # r0 past its prediction has 1 token left: it keeps its slot to the end (50), r1: 53
    assert blind["parks"] == 0
    assert blind[METRIC_S] == pytest.approx(np.mean([50 / 50, 53 / 3]))
    seen = replay(burst, VARIANTS["leap"], ONE_SLOT, 10.0, 0.5)
    # r1 runs steps 5-7, r0 resumes and writes its other 46: ends at 53
    assert seen["parks"] == 1
    assert seen[METRIC_S] == pytest.approx(np.mean([53 / 50, 7 / 3]))
