"""ARK planner and path oracles: exact argmin against brute force, balance, edge cases."""

from __future__ import annotations

import itertools
import random

import pytest

from vllm_ext.ark.fabric import Fabric, Transfer, host_name
from vllm_ext.ark.paths import HashModel, LearnedMap
from vllm_ext.ark.planner import LOCAL, PLANNED, SMALL, UNKNOWN, choose, offline_spines, plan

pytestmark = pytest.mark.unit


def _random_case(rng: random.Random, n_flows: int):
    n_leaves, n_spines = rng.randint(2, 4), rng.randint(2, 4)
    fabric = Fabric.uniform(n_leaves, 3, n_spines)
    hosts = list(fabric.leaf_of)
    function = rng.choice(HashModel.FUNCTIONS)
    oracle = HashModel(n_spines, seed=rng.randrange(1 << 30), function=function)
    flows = []
    for i in range(n_flows):
        start = rng.uniform(0, 10)
        flows.append(
            Transfer(f"t{i}", rng.choice(hosts), rng.choice(hosts), rng.randint(1, 10**9),
                     start, start + rng.uniform(0, 5), rng.randint(1024, 65535), 7000)
        )  # fmt: skip
    return fabric, oracle, flows


def _brute_cost(t: Transfer, port: int, announced, fabric: Fabric, oracle) -> tuple[float, float]:
    """The cost of one candidate straight from its definition."""
    spine = oracle.spine(t.src, t.dst, port, t.dst_port)
    a, b = fabric.leaf(t.src), fabric.leaf(t.dst)
    up = down = 0.0
    for o in announced:
        if o.transfer_id == t.transfer_id or fabric.leaf(o.src) == fabric.leaf(o.dst):
            continue
        if oracle.spine(o.src, o.dst, o.port, o.dst_port) != spine:
            continue
        lo, hi = max(o.start, t.start), min(o.end, t.end)
        if hi < lo:
            continue
        share = o.nbytes if o.end == o.start else o.nbytes * (hi - lo) / (o.end - o.start)
        up += share if fabric.leaf(o.src) == a else 0.0
        down += share if fabric.leaf(o.dst) == b else 0.0
    return max(up, down), up + down


@pytest.mark.parametrize("seed", range(40))
def test_choice_is_the_brute_force_argmin(seed):
    rng = random.Random(seed)
    fabric, oracle, flows = _random_case(rng, rng.randint(1, 25))
    new = flows.pop()
    candidates = rng.sample(range(20000, 60000), rng.randint(1, 12))
    choice = choose(new, flows, fabric, oracle, candidates)
    if fabric.leaf(new.src) == fabric.leaf(new.dst):
        assert choice.reason == LOCAL and choice.port == new.port
        return
    costs = {p: _brute_cost(new, p, flows, fabric, oracle) for p in candidates}
    best = min(costs.values())
    assert choice.reason == PLANNED and choice.port in candidates
    assert choice.cost == pytest.approx(costs[choice.port])
    assert costs[choice.port] == pytest.approx(best)
    assert choice.spine == oracle.spine(new.src, new.dst, choice.port, new.dst_port)


def _max_link_load(flows, spines, fabric):
    load: dict = {}
    for f, s in zip(flows, spines, strict=True):
        for link in (("up", fabric.leaf(f.src), s), ("down", s, fabric.leaf(f.dst))):
            load[link] = load.get(link, 0) + f.nbytes
    return max(load.values())


@pytest.mark.parametrize("seed", range(20))
def test_sequential_planning_balances_a_leaf_pair_optimally(seed):
    """Simultaneous flows leaf 0 -> leaf 1, each planned against the ones before it."""
    rng = random.Random(seed)
    n_spines, n_flows = rng.randint(2, 4), rng.randint(2, 7)
    fabric = Fabric.uniform(2, 4, n_spines)
    oracle = HashModel(n_spines, seed=seed)
    candidates = list(range(30000, 30064))  # 64 ports: every spine is reachable
    sizes = [rng.choice([10**6, 10**6, 3 * 10**6]) for _ in range(n_flows)]
    placed: list[Transfer] = []
    for i, size in enumerate(sorted(sizes, reverse=True)):
        t = Transfer(f"f{i}", host_name(0, i % 4), host_name(1, i % 4), size, 0.0, 1.0, 1, 9)
        placed.append(t.with_port(plan(t, placed, fabric, oracle, candidates)))
    ours = _max_link_load(placed, [oracle.spine(t.src, t.dst, t.port, 9) for t in placed], fabric)
    best = min(
        _max_link_load(placed, spines, fabric)
        for spines in itertools.product(range(n_spines), repeat=n_flows)
    )
    assert ours == best
    offline = offline_spines(placed, fabric)
    assert _max_link_load(placed, [offline[t.transfer_id] for t in placed], fabric) == best


def test_small_local_and_unknown_keep_their_port():
    fabric = Fabric.uniform(2, 2, 2)
    oracle = HashModel(2)
    t = Transfer("x", "h0_0", "h1_0", 100, 0, 1, 4242, 9)
    assert choose(t, [], fabric, oracle, [1, 2], min_bytes=101).reason == SMALL
    assert choose(t, [], fabric, oracle, [1, 2], min_bytes=101).port == 4242
    local = Transfer("y", "h0_0", "h0_1", 100, 0, 1, 4242, 9)
    assert choose(local, [], fabric, oracle, [1, 2]).reason == LOCAL
    unknown_host = Transfer("z", "h0_0", "elsewhere", 100, 0, 1, 4242, 9)
    assert choose(unknown_host, [], fabric, oracle, [1, 2]).reason == LOCAL
    blind = choose(t, [], fabric, LearnedMap(), [1, 2])
    assert (blind.reason, blind.port) == (UNKNOWN, 4242)


def test_tie_break_is_deterministic_and_spreads_over_ports():
    fabric = Fabric.uniform(2, 1, 4)
    oracle = HashModel(4, seed=3)
    candidates = list(range(40000, 40016))
    picks = set()
    for i in range(50):
        t = Transfer(f"id{i}", "h0_0", "h1_0", 10, 0, 1, 1, 9)
        first = plan(t, [], fabric, oracle, candidates)
        assert first == plan(t, [], fabric, oracle, list(reversed(candidates)))
        picks.add(first)
    assert len(picks) > 4  # an empty view does not send everyone to the lowest port


def test_announced_spine_overrides_the_oracle():
    """A learned map knows only its own paths; other senders announce theirs."""
    fabric = Fabric.uniform(2, 2, 2)
    mine = LearnedMap({("h0_0", "h1_0", 5000, 9): 0, ("h0_0", "h1_0", 5001, 9): 1})
    other = Transfer("o", "h0_1", "h1_1", 10**9, 0, 1, 777, 9, spine=1)
    t = Transfer("t", "h0_0", "h1_0", 10**9, 0, 1, 1, 9)
    assert plan(t, [other], fabric, mine, [5000, 5001]) == 5000
    other0 = Transfer("o", "h0_1", "h1_1", 10**9, 0, 1, 777, 9, spine=0)
    assert plan(t, [other0], fabric, mine, [5000, 5001]) == 5001


def test_hash_model_spreads_ports_evenly():
    for function in HashModel.FUNCTIONS:
        model = HashModel(4, seed=11, function=function)
        counts = [0] * 4
        for port in range(20000, 28000):
            counts[model.spine("10.0.0.1", "10.1.0.1", port, 7000)] += 1
        expected = 8000 / 4
        chi2 = sum((c - expected) ** 2 / expected for c in counts)
        assert chi2 < 16.3, (function, counts)  # p = 0.001 for 3 degrees of freedom
        assert model.spine("a", "b", 1, 2) == HashModel(4, 11, function).spine("a", "b", 1, 2)
    with pytest.raises(ValueError, match="unknown hash"):
        HashModel(4, function="md5")


def test_learned_map_learns_saves_and_loads(tmp_path):
    probed = []

    def probe(src, dst, sport, dport):
        probed.append(sport)
        return None if sport == 3 else sport % 2

    learned = LearnedMap()
    assert learned.learn(probe, "a", "b", 9, [1, 2, 3, 4]) == 3
    assert probed == [1, 2, 3, 4]
    assert learned.spine("a", "b", 3, 9) is None and learned.spine("a", "b", 2, 9) == 0
    again = LearnedMap.load(learned.save(tmp_path / "map.json"))
    assert again.spines_of("a", "b", 9) == {1: 1, 2: 0, 4: 0}
    again.forget("a", "b")
    assert len(again) == 0
    with pytest.raises(ValueError, match="not an ARK path map"):
        LearnedMap.from_json('{"version": 2}')


def test_transfer_rejects_bad_fields():
    with pytest.raises(ValueError, match="nbytes"):
        Transfer("a", "s", "d", -1, 0, 1, 1)
    with pytest.raises(ValueError, match="end"):
        Transfer("a", "s", "d", 1, 2, 1, 1)
    with pytest.raises(ValueError, match="port"):
        Transfer("a", "s", "d", 1, 0, 1, 70000)
