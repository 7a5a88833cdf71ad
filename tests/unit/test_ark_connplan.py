"""Planned ports for NIXL's pull connections: the chosen port is the KV flow's destination
port; a pair's connections and those of several peers spread over the spines of a random
probed path map as evenly as the map allows; unknown paths keep free ports; a port is
never given twice."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from vllm_ext.ark.connplan import ConnectionPlan
from vllm_ext.ark.fabric import Fabric
from vllm_ext.ark.paths import LearnedMap

pytestmark = pytest.mark.unit

LOCAL, LISTENER = "10.1.0.1", 47000


def _random_map(rng, peers, candidates, n_spines, listener=LISTENER):
    paths = LearnedMap()
    for peer, port in itertools.product(peers, candidates):
        # the KV direction: prefill listener -> our port
        paths.record(peer, LOCAL, listener, port, int(rng.integers(n_spines)))
    return paths


@pytest.mark.parametrize("seed", range(20))
def test_connections_spread_as_evenly_as_the_map_allows(seed):
    rng = np.random.default_rng(seed)
    n_spines, n_peers, per_peer = int(rng.integers(2, 5)), int(rng.integers(1, 4)), 4
    peers = [f"10.0.0.{i + 1}" for i in range(n_peers)]
    candidates = list(range(41000, 41000 + n_peers * per_peer + int(rng.integers(0, 40))))
    fabric = Fabric({**{p: 0 for p in peers}, LOCAL: 1}, n_spines)
    paths = _random_map(rng, peers, candidates, n_spines)
    plan = ConnectionPlan(LOCAL, fabric, paths, candidates)
    ports = [plan.ports(peer, LISTENER, per_peer) for peer in peers]
    flat = [p for group in ports for p in group]
    assert len(flat) == len(set(flat)) == n_peers * per_peer and set(flat) <= set(candidates)
    assert plan.planned == len(flat) and plan.kept == 0
    # every connection's spine is the probed one for its 5-tuple
    for peer, group in zip(peers, ports, strict=True):
        for port in group:
            assert plan.spines()[port] == paths.spine(peer, LOCAL, LISTENER, port)
    # greedy onto the least loaded spine: no spine carries two more connections than another
    # unless the map offered no free port on the lighter spine at that step
    load = np.bincount([plan.spines()[p] for p in flat], minlength=n_spines)
    reachable = {paths.spine(peer, LOCAL, LISTENER, p) for peer in peers for p in candidates}
    if reachable == set(range(n_spines)) and len(candidates) >= 4 * n_peers * per_peer:
        assert load.max() - load.min() <= 1, load


def test_the_listener_port_is_part_of_the_path():
    fabric = Fabric({"10.0.0.1": 0, LOCAL: 1}, 2)
    paths = LearnedMap()
    for port in (41000, 41001):
        paths.record("10.0.0.1", LOCAL, 47000, port, port - 41000)
        paths.record("10.0.0.1", LOCAL, 47001, port, 41001 - port)
    for listener in (47000, 47001):
        plan = ConnectionPlan(LOCAL, fabric, paths, [41000, 41001])
        assert sorted(plan.spines().get(p, -1) for p in plan.ports("10.0.0.1", listener, 2)) \
            == [0, 1]  # fmt: skip


def test_unknown_paths_keep_free_ports_and_ports_run_out():
    fabric = Fabric({"10.0.0.1": 0, "10.0.0.2": 0, LOCAL: 1}, 2)
    plan = ConnectionPlan(LOCAL, fabric, LearnedMap(), [41000, 41001, 41002])
    first = plan.ports("10.0.0.1", LISTENER, 2)
    second = plan.ports("10.0.0.2", LISTENER, 2)
    assert first + second == [41000, 41001, 41002]  # the 4th connection gets no port
    assert (plan.planned, plan.kept) == (0, 3)
    same_leaf = ConnectionPlan(LOCAL, Fabric({"10.0.0.1": 1, LOCAL: 1}, 2),
                               _random_map(np.random.default_rng(0), ["10.0.0.1"],
                                           [41000, 41001], 2), [41000, 41001])  # fmt: skip
    assert same_leaf.ports("10.0.0.1", LISTENER, 2) == [41000, 41001] and same_leaf.kept == 2
