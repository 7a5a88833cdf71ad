"""ARK's flow simulator: max-min fairness, event times, and the variants on a small fabric."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_ext.ark import flowsim
from vllm_ext.ark.simulator import VARIANTS, SimConfig, run
from vllm_ext.ark.traces import KvGeometry, PrefillModel, pd_trace

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("seed", range(30))
def test_maxmin_rates_are_feasible_and_bottlenecked(seed):
    """Every flow has a saturated link on which no other flow is faster (max-min definition)."""
    rng = np.random.default_rng(seed)
    n_links, n_flows = int(rng.integers(1, 6)), int(rng.integers(1, 8))
    capacity = rng.uniform(1, 10, n_links)
    paths = np.full((n_flows, 3), -1)
    for f in range(n_flows):
        hops = rng.choice(n_links, int(rng.integers(1, min(3, n_links) + 1)), replace=False)
        paths[f, : len(hops)] = hops
    rates = flowsim.maxmin_rates(paths, capacity)
    load = np.zeros(n_links)
    for f in range(n_flows):
        for link in paths[f][paths[f] >= 0]:
            load[link] += rates[f]
    assert (load <= capacity * (1 + 1e-9)).all()
    for f in range(n_flows):
        links = paths[f][paths[f] >= 0]
        bottlenecked = [
            link for link in links
            if load[link] >= capacity[link] * (1 - 1e-9)
            and rates[f] >= max(rates[g] for g in range(n_flows) if link in paths[g]) - 1e-9
        ]  # fmt: skip
        assert bottlenecked, (f, rates, load, capacity)


def test_simulate_event_times():
    capacity = np.array([10.0, 10.0, 4.0])
    paths = np.array([[0, 2], [1, 2], [0, -1]])
    finish = flowsim.simulate(np.array([0.0, 0.0, 1.0]), np.array([10.0, 10.0, 10.0]), paths,
                              capacity)  # fmt: skip
    # 2 + 2 on the 4-capacity link; flow 2 gets the 8 left on link 0 from t=1
    assert finish == pytest.approx([5.0, 5.0, 2.25])


def test_kv_bytes_and_fcfs_prefill():
    geometry = KvGeometry(layers=2, kv_heads=3, head_dim=4, dtype_bytes=2)
    assert geometry.bytes_per_token == 2 * 2 * 3 * 4 * 2
    trace = pd_trace(200, 50.0, 2, 3, seed=1, geometry=geometry, model=PrefillModel())
    assert (trace.kv_bytes == trace.tokens * geometry.bytes_per_token).all()
    assert (trace.prefill_start >= trace.arrival).all()
    for host in range(2):  # one prefill at a time per instance, in arrival order
        mine = trace.prefill_host == host
        assert (trace.prefill_start[mine][1:] >= trace.prefill_end[mine][:-1] - 1e-12).all()
    assert set(np.unique(trace.decode_host)) <= {0, 1, 2}


def test_variants_on_a_small_fabric():
    cfg = SimConfig(n_leaves=4, hosts_per_leaf=4, n_spines=4, n_requests=150, utilization=0.7)
    results = run(cfg, seed=3)
    assert set(results) == set(VARIANTS)
    for metrics in results.values():
        assert metrics["mean_fct_s"] > 0 and metrics["mean_ttft_s"] > metrics["mean_fct_s"]
        assert sum(metrics["spine_bytes_gb"]) == pytest.approx(
            results["random"]["mean_kv_mb"] * cfg.n_requests / 1e3, rel=1e-6
        )
    assert results["ark"]["planner_planned"] == cfg.n_requests
    assert results["spray"]["uplink_max_over_mean"] == pytest.approx(1.0)
    # same trace for all: queue and prefill are network-independent
    assert len({m["mean_prefill_s"] for m in results.values()}) == 1
    assert results["ark"]["uplink_max_over_mean"] < results["random"]["uplink_max_over_mean"]
