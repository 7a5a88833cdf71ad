"""HiState's and LEAP's gauges and histograms through vLLM 0.34's own ``KVConnectorProm``:
the class vLLM's API server builds from ``--kv-transfer-config``, fed the stats the
connectors' scheduler halves drain, aggregated as vLLM aggregates them."""

from __future__ import annotations

import re
from types import SimpleNamespace

import prometheus_client
import pytest
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm

LABELS = 'model_name="m",engine="0"'


def _prom(connector: str, module: str) -> KVConnectorProm:
    config = KVTransferConfig(kv_connector=connector, kv_connector_module_path=module,
                              kv_role="kv_both")  # fmt: skip
    return KVConnectorProm(SimpleNamespace(kv_transfer_config=config), ["model_name", "engine"],
                           {0: ["m", "0"]})  # fmt: skip


def _sample(text: str, name: str, labels: str) -> float:
    """Sample ``name`` whose labels are exactly ``labels`` (``k="v"`` pairs), in any order."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = dict(re.findall(r'(\w+)="([^"]*)"', labels))
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == wanted:
                return sample.value
    raise AssertionError((name, labels))


def test_histate_tier_gauges_and_restore_histogram_reach_metrics():
    from vllm_ext.histate.connector import HiStateConnector

    prom = _prom("HiStateConnector", "vllm_ext.histate.connector")
    counters = HiStateConnector.make_counters()
    counters.inc("hit_tokens", 384)
    counters.set("tier_used_bytes", 1 << 20, "host")
    counters.observe("restore_seconds", 0.003)
    stats = HiStateConnector.build_kv_connector_stats(counters.drain())
    counters.set("tier_used_bytes", 3 << 20, "host")  # the next step's value wins
    counters.set("tier_used_bytes", 0, "ssd")
    counters.observe("restore_seconds", 0.2)
    stats = stats.aggregate(HiStateConnector.build_kv_connector_stats(counters.drain()))
    prom.observe(stats.data, engine_idx=0)
    text = prometheus_client.generate_latest().decode()
    assert _sample(text, "vllm_ext:histate_hit_tokens_total", LABELS) == 384
    assert _sample(text, "vllm_ext:histate_tier_used_bytes", LABELS + ',tier="host"') == 3 << 20
    assert _sample(text, "vllm_ext:histate_tier_used_bytes", LABELS + ',tier="ssd"') == 0
    assert _sample(text, "vllm_ext:histate_restore_seconds_count", LABELS) == 2
    assert _sample(text, "vllm_ext:histate_restore_seconds_bucket", LABELS + ',le="0.005"') == 1
    assert "# TYPE vllm_ext:histate_tier_used_bytes gauge" in text


def test_leap_queue_gauge_and_prediction_error_histogram_reach_metrics():
    from vllm_ext.leap.connector import LeapConnector

    prom = _prom("LeapConnector", "vllm_ext.leap.connector")
    counters = LeapConnector.make_counters()
    counters.set("queue_length", 7, "waiting")
    counters.set("queue_length", 2, "running")
    counters.observe("prediction_abs_log_error", 0.3)
    prom.observe(LeapConnector.build_kv_connector_stats(counters.drain()).data, engine_idx=0)
    text = prometheus_client.generate_latest().decode()
    assert _sample(text, "vllm_ext:leap_queue_length", LABELS + ',queue="waiting"') == 7
    assert _sample(text, "vllm_ext:leap_queue_length", LABELS + ',queue="running"') == 2
    assert _sample(text, "vllm_ext:leap_prediction_abs_log_error_sum", LABELS) == pytest.approx(0.3)
