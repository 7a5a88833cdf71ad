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


def _mixed() -> Counters:
    from vllm_ext.common.counters import GaugeSpec, HistogramSpec

    return Counters("sys", [CounterSpec("hits", "h"), GaugeSpec("used_bytes", "u", label="tier"),
                            GaugeSpec("queue", "q"),
                            HistogramSpec("wait_seconds", "w", (0.1, 1.0))])  # fmt: skip


def test_gauges_send_their_latest_change_and_histograms_every_observation():
    c = _mixed()
    c.inc("hits")
    c.set("used_bytes", 10, "host")
    c.set("used_bytes", 20, "host")
    c.set("queue", 3)
    c.observe("wait_seconds", 0.5)
    c.observe("wait_seconds", 2.0)
    assert c.drain() == {"hits": 1.0, "gauge:used_bytes:host": 20.0, "gauge:queue": 3.0,
                         "hist:wait_seconds": [0.5, 2.0]}  # fmt: skip
    assert c.observed("wait_seconds") == 2
    c.set("queue", 3)  # unchanged: nothing to send
    assert c.drain() == {} and c.gauge("queue") == 3.0 and c.gauge("used_bytes", "ssd") is None


def test_gauge_labels_and_metric_kinds_are_checked():
    c = _mixed()
    with pytest.raises(ValueError, match="takes label 'tier'"):
        c.set("used_bytes", 1)
    with pytest.raises(KeyError):
        c.set("hits", 1)
    with pytest.raises(KeyError):
        c.observe("queue", 1.0)
    with pytest.raises(KeyError):
        c.inc("queue")


def test_merged_updates_add_counters_keep_latest_gauges_and_append_observations():
    from vllm_ext.common.counters import merge_updates

    merged = merge_updates({"hits": 1.0, "gauge:queue": 1.0, "hist:w": [0.1]},
                           {"hits": 2.0, "gauge:queue": 5.0, "hist:w": [0.2]})  # fmt: skip
    assert merged == {"hits": 3.0, "gauge:queue": 5.0, "hist:w": [0.1, 0.2]}


def test_gauges_and_histograms_reach_prometheus_in_vllm_naming():
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    import prometheus_client
    from prometheus_client import Counter, Gauge, Histogram

    from vllm_ext.common.prom import CounterPromMetrics, CounterStats

    c = _mixed()
    metrics = CounterPromMetrics(
        SimpleNamespace(kv_transfer_config=None),
        {Gauge: Gauge, Counter: Counter, Histogram: Histogram},
        ["model_name", "engine"], {0: ["m", "0"]}, "sys", c.specs,
    )  # fmt: skip
    c.inc("hits", 2)
    c.set("used_bytes", 7, "host")
    c.set("queue", 4)
    c.observe("wait_seconds", 0.5)
    first = CounterStats(data=c.drain())
    c.set("queue", 6)
    c.observe("wait_seconds", 0.05)
    stats = first.aggregate(CounterStats(data=c.drain()))
    metrics.observe(stats.data, engine_idx=0)
    text = prometheus_client.generate_latest().decode()
    base = {"model_name": "m", "engine": "0"}
    assert _sample(text, "vllm_ext:sys_hits_total", base) == 2.0
    assert _sample(text, "vllm_ext:sys_used_bytes", {**base, "tier": "host"}) == 7.0
    assert _sample(text, "vllm_ext:sys_queue", base) == 6.0
    assert _sample(text, "vllm_ext:sys_wait_seconds_count", base) == 2.0
    assert _sample(text, "vllm_ext:sys_wait_seconds_bucket", {**base, "le": "0.1"}) == 1.0
    assert stats.reduce()["hist:wait_seconds"] == 2


def _sample(text: str, name: str, labels: dict) -> float | None:
    """The value of sample ``name`` with exactly ``labels`` on a Prometheus text page
    (whatever order the exporter writes the labels in)."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    return None
