"""``instance`` seams checked on the real objects this release builds (not just their classes).

vLLM's own ``create_scheduler`` builds a ``Scheduler`` with its ``KVCacheManager``,
``BlockPool`` and an ``ExampleConnector`` (a real ``KVConnectorBase_V1``); one
scheduled step gives a ``SchedulerOutput``; the connector metrics class is
built as vLLM's logger builds it. Every instance entry is either verified here
or listed in ``compat_evidence.INSTANCE_TESTS`` as not built on this release, and
the test fails when the two disagree (a new instance entry must be built here).
Runs on any release whose code and tests the process imports (``make test-034``;
the 0.32 engine tier runs it against 0.32's, tests/engine/test_compat_seams.py).
"""

from __future__ import annotations

import os

import pytest
from tests.v1.core.utils import create_requests, create_scheduler

from vllm_ext.common import compat, compat_evidence

RELEASE = os.environ.get("VLLM_EXT_RELEASE_UNDER_TEST", "0.32.0")


def _prom_metrics(vllm_config):
    from prometheus_client import Counter, Gauge, Histogram
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics

    # the metric classes vLLM's PrometheusStatLogger hands every connector's metrics
    types = {Gauge: Gauge, Counter: Counter, Histogram: Histogram}
    return KVConnectorPromMetrics(vllm_config, types, [], {0: []})


def test_every_instance_entry_holds_on_this_releases_objects():
    scheduler = create_scheduler(use_kv_connector=True, enable_prefix_caching=True)
    requests = create_requests(num_requests=2, num_tokens=32)
    for request in requests:
        scheduler.add_request(request)
    output = scheduler.schedule()
    manager = scheduler.kv_cache_manager
    built = [
        ("leap", scheduler, "Scheduler"),
        ("histate", manager, "KVCacheManager"),
        ("histate", manager.block_pool, "BlockPool"),
        ("histate", output, "SchedulerOutput"),
        ("histate", requests[0], "Request"),
        ("histate", scheduler.connector, "KVConnectorBase_V1"),
        ("ark", scheduler.connector, "KVConnectorBase_V1"),
        ("acct", scheduler.kv_cache_config, "KVCacheConfig"),
        ("common", _prom_metrics(scheduler.vllm_config), "KVConnectorPromMetrics"),
        ("ark", _prom_metrics(scheduler.vllm_config), "KVConnectorPromMetrics"),
    ]
    if getattr(output, "kv_connector_block_state", None) is not None:
        built.append(("histate", output.kv_connector_block_state, "KVConnectorBlockState"))
    compat.VERIFIED_INSTANCES.clear()
    for system, obj, qualname in built:
        compat.check_instance(system, obj, qualname)
    series = compat.parse_series(compat.installed_vllm_version() or "")
    # entries of a range of releases (Seam.releases) are wanted only where they apply
    wanted = {s.name for s in compat.SEAMS if s.kind == "instance" and s.applies_to(series)}
    if not compat.has_v1_runner():
        wanted -= {s.name for s in compat.SEAMS if s.runner == "v1"}
    _, not_built = compat_evidence.INSTANCE_TESTS[RELEASE]
    assert compat.VERIFIED_INSTANCES == wanted - not_built, (
        "instance entries verified here and compat_evidence.INSTANCE_TESTS disagree"
    )


def test_a_missing_instance_attribute_is_named():
    scheduler = create_scheduler()
    del scheduler.policy
    with pytest.raises(compat.VllmCompatError, match=r"Scheduler\.policy missing on Scheduler"):
        compat.check_instance("leap", scheduler, "Scheduler")
