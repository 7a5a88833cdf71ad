"""ARK's counters on vLLM's /metrics, the drop family as one labelled counter.

``vllm_ext:ark_<name>_total`` per counter, except the announcement drops:
``vllm_ext:ark_announcements_dropped_total{reason="malformed"|"huge"|"unknown_peer"|
"overflow"|"bad_mac"}``. Extends vLLM's ``KVConnectorPromMetrics`` (checked on 0.32.0)
like :mod:`vllm_ext.common.prom`, whose stats plumbing ARK reuses.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics

from vllm_ext.ark.counters import COUNTER_SPECS, DROP_REASONS, DROPPED, SYSTEM
from vllm_ext.common.prom import _unregister, metric_name


class ArkPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._series: dict[str, dict[int, Any]] = {}
        for spec in COUNTER_SPECS:
            if spec.name.startswith(DROPPED + "_"):
                continue
            name = metric_name(SYSTEM, spec.name)
            _unregister(name)
            counter = self._counter_cls(name=name, documentation=spec.doc, labelnames=labelnames)
            self._series[spec.name] = {
                idx: counter.labels(*values) for idx, values in per_engine_labelvalues.items()
            }
        name = metric_name(SYSTEM, DROPPED)
        _unregister(name)
        dropped = self._counter_cls(
            name=name,
            documentation="announcements dropped, by reason (" + ", ".join(DROP_REASONS) + ")",
            labelnames=[*labelnames, "reason"],
        )
        for reason in DROP_REASONS:
            self._series[f"{DROPPED}_{reason}"] = {
                idx: dropped.labels(*values, reason)
                for idx, values in per_engine_labelvalues.items()
            }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, amount in transfer_stats_data.items():
            series = self._series.get(name)
            if series is not None and amount > 0:
                series[engine_idx].inc(amount)
