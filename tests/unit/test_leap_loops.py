"""loops.loop_period: the shortest cycle of a token tail, checked against brute force."""

from __future__ import annotations

import random

import pytest

from vllm_ext.leap.loops import first_loop, loop_period


def _brute_force(tokens, max_period, min_span):
    """The definition, one period and one position at a time."""
    for p in range(1, max_period + 1):
        span = max(min_span, p)
        if span + p > len(tokens):
            continue
        if all(tokens[-i] == tokens[-i - p] for i in range(1, span + 1)):
            return p
    return None


def test_a_cycle_is_found_once_it_covers_the_span():
    prefix = [1, 2, 3, 4, 5, 6, 7]
    cycle = [10, 11, 12]
    tokens = prefix + cycle * 6  # 18 tokens of the cycle
    assert loop_period(tokens, max_period=8, min_span=15) == 3
    assert loop_period(tokens, max_period=8, min_span=16) is None  # 15 + 3 > 18
    assert loop_period(tokens, max_period=2, min_span=6) is None  # the cycle is longer


def test_the_shortest_period_wins_and_a_single_token_loop_counts():
    assert loop_period([5] * 20, max_period=4, min_span=8) == 1
    tokens = [9, 8] + [1, 2, 1, 2] * 5
    assert loop_period(tokens, max_period=8, min_span=8) == 2


def test_a_broken_cycle_or_a_short_output_is_not_a_loop():
    tokens = [1, 2, 3] * 8
    tokens[-5] = 99  # one deviation inside the span
    assert loop_period(tokens, max_period=8, min_span=9) is None
    assert loop_period([], max_period=8, min_span=4) is None
    assert loop_period([1], max_period=8, min_span=4) is None


def test_a_long_cycle_must_be_seen_twice():
    cycle = list(range(20))
    # span = max(4, 20): 40 tokens of the cycle needed
    assert loop_period([100] + cycle + cycle[:19], max_period=32, min_span=4) is None
    assert loop_period([100] + cycle * 2, max_period=32, min_span=4) == 20


@pytest.mark.parametrize("seed", range(6))
def test_equals_brute_force_on_random_tails(seed):
    rng = random.Random(seed)
    for _ in range(400):
        alphabet = rng.choice([2, 3, 50])
        tokens = [rng.randrange(alphabet) for _ in range(rng.randrange(0, 40))]
        if rng.random() < 0.6:  # end in a (possibly broken) cycle
            cycle = [rng.randrange(alphabet) for _ in range(rng.randrange(1, 9))]
            tokens += (cycle * 30)[: rng.randrange(0, 80)]
            if tokens and rng.random() < 0.3:
                tokens[rng.randrange(len(tokens))] = rng.randrange(alphabet)
        max_period, min_span = rng.randrange(1, 12), rng.randrange(1, 30)
        assert loop_period(tokens, max_period, min_span) == _brute_force(
            tokens, max_period, min_span
        ), (tokens, max_period, min_span)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="max_period"):
        loop_period([1, 1, 1], max_period=0, min_span=4)


def test_first_loop_is_the_first_due_check_that_sees_the_cycle():
    tokens = list(range(50)) + [7, 8] * 40  # the cycle starts at 50
    # the span (16) and one cycle are there at 68; checks fall at 24, 32, ..., 64, 72
    assert loop_period(tokens[:68], 4, 16) == 2 and loop_period(tokens[:67], 4, 16) is None
    assert first_loop(tokens, max_period=4, min_span=16, every=8) == 72
    assert first_loop(tokens, max_period=4, min_span=16, every=4) == 68
    assert first_loop(tokens[:70], max_period=4, min_span=16, every=8) is None
    assert first_loop([3] * 40, max_period=4, min_span=16, every=8) == 24  # first check > span
