"""Publish a system's :class:`~vllm_ext.common.counters.Counters` on vLLM's ``/metrics``.

Extends vLLM's ``KVConnectorStats`` / ``KVConnectorPromMetrics`` (checked on
vLLM 0.32.0). Metrics created in EngineCore or worker processes are never
exported; the supported path is: connector ``get_kv_connector_stats()`` (worker
and scheduler side, aggregated by the scheduler) → ``SchedulerStats`` → API
server → ``build_prom_metrics(...).observe()``. A connector that mixes in
:class:`PublishesCounters` gets all of that from two class attributes.

Exported names: ``vllm_ext:<system>_<counter>_total``, gauges
``vllm_ext:<system>_<gauge>`` (with their own label, if declared) and histograms
``vllm_ext:<system>_<histogram>_{bucket,sum,count}``, all with vLLM's
``model_name`` / ``engine`` labels.
"""

from __future__ import annotations

from typing import Any, ClassVar

import prometheus_client
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.utils import create_metric_per_engine

from vllm_ext.common.counters import (
    GAUGE,
    HIST,
    Counters,
    CounterSpec,
    GaugeSpec,
    HistogramSpec,
    merge_updates,
)

METRIC_PREFIX = "vllm_ext:"


class CounterStats(KVConnectorStats):
    """Counter increments for one interval: ``data = {counter name: amount}``."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        merge_updates(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        # vLLM logs this: observations as their count
        return {k: len(v) if k.startswith(HIST) else v for k, v in self.data.items()}

    def is_empty(self) -> bool:
        return not self.data


def metric_name(system: str, counter: str) -> str:
    """Prometheus base name (the client adds ``_total``)."""
    return f"{METRIC_PREFIX}{system}_{counter}"


def _unregister(name: str) -> None:
    # a second engine in the same process (tests, restarts) re-creates its metrics;
    # vLLM does the same for its own ``vllm:`` names in PrometheusStatLogger.__init__
    registry = prometheus_client.REGISTRY
    for collector in list(registry._collector_to_names):
        if name in registry._collector_to_names[collector]:
            registry.unregister(collector)


class CounterPromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per :class:`CounterSpec`, gauge per :class:`GaugeSpec` and
    histogram per :class:`HistogramSpec`, per engine."""

    def __init__(
        self,
        vllm_config,
        metric_types,
        labelnames,
        per_engine_labelvalues,
        system: str,
        specs: tuple[CounterSpec, ...],
    ):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._per_engine: dict[str, dict[int, Any]] = {}
        # labelled gauges: the metric and its label, bound per engine at observe time
        self._labelled: dict[str, Any] = {}
        for spec in specs:
            name = metric_name(system, spec.name)
            _unregister(name)
            if isinstance(spec, GaugeSpec):
                names = [*labelnames, spec.label] if spec.label else labelnames
                # the latest value wins across API-server processes, as vLLM's own gauges
                gauge = self._gauge_cls(name=name, documentation=spec.doc, labelnames=names,
                                        multiprocess_mode="mostrecent")  # fmt: skip
                if spec.label:
                    self._labelled[GAUGE + spec.name] = gauge
                else:
                    per_engine = create_metric_per_engine(gauge, per_engine_labelvalues)
                    self._per_engine[GAUGE + spec.name] = per_engine
            elif isinstance(spec, HistogramSpec):
                histogram = self._histogram_cls(name=name, documentation=spec.doc,
                                                labelnames=labelnames,
                                                buckets=list(spec.buckets))  # fmt: skip
                per_engine = create_metric_per_engine(histogram, per_engine_labelvalues)
                self._per_engine[HIST + spec.name] = per_engine
            else:
                counter = self._counter_cls(name=name, documentation=spec.doc,
                                            labelnames=labelnames)  # fmt: skip
                per_engine = create_metric_per_engine(counter, per_engine_labelvalues)
                self._per_engine[spec.name] = per_engine

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.items():
            if key.startswith(GAUGE):
                self._set_gauge(key, value, engine_idx)
                continue
            per_engine = self._per_engine.get(key)
            if per_engine is None:
                continue
            if key.startswith(HIST):
                for observation in value:
                    per_engine[engine_idx].observe(observation)
            elif value > 0:
                per_engine[engine_idx].inc(value)

    def _set_gauge(self, key: str, value: float, engine_idx: int) -> None:
        name, _, label = key.partition(":")[2].partition(":")
        if label:
            gauge = self._labelled.get(GAUGE + name)
            if gauge is not None:
                gauge.labels(*self.per_engine_labelvalues[engine_idx], label).set(value)
        elif (per_engine := self._per_engine.get(GAUGE + name)) is not None:
            per_engine[engine_idx].set(value)


class PublishesCounters:
    """Mixin for a KV connector whose system publishes counters.

    Set ``COUNTER_SYSTEM`` and ``COUNTER_SPECS`` on the class and create
    ``self.counters = self.make_counters()`` in ``__init__``; both roles then
    report their increments every step.
    """

    COUNTER_SYSTEM: ClassVar[str]
    COUNTER_SPECS: ClassVar[tuple[CounterSpec | GaugeSpec | HistogramSpec, ...]]
    counters: Counters

    @classmethod
    def make_counters(cls) -> Counters:
        return Counters(cls.COUNTER_SYSTEM, cls.COUNTER_SPECS)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        increments = self.counters.drain()
        return CounterStats(data=increments) if increments else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return CounterStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return CounterPromMetrics(
            vllm_config,
            metric_types,
            labelnames,
            per_engine_labelvalues,
            cls.COUNTER_SYSTEM,
            cls.COUNTER_SPECS,
        )
