"""Counters: declared names only, monotonic, drained as increments."""

from __future__ import annotations

import threading

import pytest

from vllm_ext.common.counters import Counters, CounterSpec

SPECS = (CounterSpec("predictions", "predictions made"), CounterSpec("fallbacks", "FCFS fallbacks"))


def test_drain_returns_increments_since_last_drain():
    c = Counters("demo", SPECS)
    c.inc("predictions")
    c.inc("predictions", 2)
    assert c.drain() == {"predictions": 3.0}
    assert c.drain() == {}
    c.inc("fallbacks")
    assert c.drain() == {"fallbacks": 1.0}
    assert c.value("predictions") == 3.0


def test_unknown_counter_names_the_declared_ones():
    c = Counters("demo", SPECS)
    with pytest.raises(KeyError, match="predictions, fallbacks"):
        c.inc("predicitons")


def test_counters_never_decrease():
    with pytest.raises(ValueError):
        Counters("demo", SPECS).inc("predictions", -1)


@pytest.mark.parametrize("name", ["Bad", "x_total", "1x", "a-b"])
def test_counter_names_are_checked(name):
    with pytest.raises(ValueError):
        CounterSpec(name, "doc")


def test_duplicate_specs_rejected():
    with pytest.raises(ValueError, match="duplicate"):
        Counters("demo", SPECS + SPECS[:1])


def test_concurrent_increments_are_not_lost():
    c = Counters("demo", SPECS)

    def work():
        for _ in range(10_000):
            c.inc("predictions")

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert c.drain() == {"predictions": 40_000.0}
