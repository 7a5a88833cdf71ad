"""MemX cost and memory model: hand-computed cases, monotonicity, brute force vs search."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from vllm_ext.memx import model as mm
from vllm_ext.memx.search import (
    Objective,
    Space,
    compositions,
    group_options,
    search,
)
from vllm_ext.memx.spec import GIB, cluster_from_dict, model_from_dict

TINY = {
    "name": "tiny",
    "layers": 4,
    "hidden": 64,
    "ffn": 128,
    "heads": 4,
    "kv_heads": 2,
    "vocab": 100,
    "zero_stage": 0,
}


def group(name, vendor, count=4, per_node=4, mem=1.0, tflops=100.0, **kw):
    return {
        "name": name,
        "vendor": vendor,
        "type": name.upper(),
        "count": count,
        "gpus_per_node": per_node,
        "mem_gib": mem,
        "bf16_tflops": tflops,
        "mfu": 0.5,
        "hbm_gbps": 1000,
        "intra_gbps": 100,
        "inter_gbps": 10,
        "workspace_gib": 0.0,
        **kw,
    }


def test_layer_params_by_hand():
    m = model_from_dict(TINY)
    # q,o: 2·64·64; k,v: 2·64·(2·16); SwiGLU 3·64·128; norms 2·64
    assert m.layer_params == 8192 + 4096 + 24576 + 128
    assert m.embed_params == 6400


def test_peak_by_hand():
    m = model_from_dict(TINY)
    grp = cluster_from_dict({"cross_vendor_gbps": 1, "groups": [group("a", "x")]}).groups[0]
    # middle stage, 2 layers on one device, no TP/DP, batch 1 × seq 8, 3 micro-batches in flight
    peak = mm.peak_bytes(m, grp, 8, 1, 2, 1, 1, 1, 0, 3, 0, 0)
    static = 2 * m.layer_params * (2 + 2 + 12)
    act = 3 * 2 * 8 * 64 * (10 + 24)
    assert peak == pytest.approx(static + act)
    # recompute keeps the other layers' inputs (2 bytes/token/hidden) plus one layer's working set
    peak_rc = mm.peak_bytes(m, grp, 8, 1, 2, 1, 1, 1, 1, 3, 0, 0)
    assert peak_rc == pytest.approx(static + (3 * 2 - 1) * 2 * 8 * 64 + 8 * 64 * 34)
    # ZeRO-1 shards the optimizer state over dp
    zero1 = model_from_dict(TINY | {"zero_stage": 1})
    assert mm.static_bytes(zero1, 1000, 4) == pytest.approx(1000 * (2 + 2 + 12 / 4))


def test_memory_monotone_in_micro_batch_and_recompute_lowers_it():
    m = model_from_dict(TINY | {"hidden": 256, "ffn": 512, "heads": 8, "kv_heads": 8})
    grp = cluster_from_dict({"cross_vendor_gbps": 1, "groups": [group("a", "x")]}).groups[0]
    rng = np.random.default_rng(0)
    for _ in range(50):
        seq, n, infl = int(rng.integers(64, 4096)), int(rng.integers(1, 8)), int(rng.integers(1, 6))
        tp, dp = int(rng.choice([1, 2, 4])), int(rng.choice([1, 2]))
        peaks = [
            mm.peak_bytes(m, grp, seq, mb * dp, n, 1, dp, tp, 0, infl, 1, 1) for mb in (1, 2, 4, 8)
        ]
        assert np.all(np.diff(peaks) > 0)
        rc, plain = (mm.peak_bytes(m, grp, seq, dp, n, 1, dp, tp, r, infl, 0, 1) for r in (1, 0))
        # recompute lowers the peak once two or more layer inputs are kept; one: equal
        assert rc < plain if n * infl >= 2 else rc == pytest.approx(plain)


def test_compositions_are_complete():
    rows = compositions(6, 3)
    assert len(rows) == 10 and set(map(tuple, rows)) == {
        c for c in itertools.product(range(1, 5), repeat=3) if sum(c) == 6
    }


def _brute_force(space: Space, objective: Objective):
    """Plain loops over every plan, scalar calls: (memx score, time) of each ranking's best."""
    m, groups = space.model, space.cluster.groups
    ideal = mm.ideal_time(m, groups, space.seq, space.global_batch)
    best = {"memx": (np.inf, None), "metis": (np.inf, None)}
    for order in itertools.permutations(range(len(groups))):
        for mb in space.micro_batches:
            opts = [group_options(space, g, mb) for g in order]
            for choice in itertools.product(*opts):
                stages = [int(c[0]) for c in choice]
                for split in compositions(m.layers, len(order)):
                    if any(n < k for n, k in zip(split, stages, strict=True)):
                        continue
                    times, tails, utils, before = [], [], [], 0
                    for p, g in enumerate(order):
                        k, dp, tp, rc = (int(v) for v in choice[p])
                        first, last = int(p == 0), int(p == len(order) - 1)
                        hop = (
                            space.cluster.link_gbps(groups[g], groups[order[p + 1]])
                            if not last
                            else groups[g].inter_gbps
                        )
                        n = int(split[p])
                        infl = min(sum(stages) - before, space.global_batch // mb)
                        times.append(
                            mm.stage_time(m, groups[g], space.seq, mb, n, k, dp, tp, rc, last, hop)
                        )
                        tails.append(
                            mm.tail_time(m, groups[g], space.seq, mb, n, k, dp, tp, rc, first, last)
                        )
                        utils.append(
                            mm.peak_bytes(
                                m, groups[g], space.seq, mb, n, k, dp, tp, rc, infl, first, last
                            )
                            / groups[g].mem_bytes
                        )
                        before += k
                    if max(utils) > 1:
                        continue
                    t = float(mm.iteration_time(times, stages, tails, space.global_batch // mb))
                    w = np.array([groups[g].count for g in order], float)
                    w /= w.sum()
                    var = float(w @ (np.array(utils) - w @ np.array(utils)) ** 2)
                    score = float(objective.score(t / ideal, max(utils), var))
                    key = (order, mb, tuple(map(tuple, choice)), tuple(split))
                    best["memx"] = min(best["memx"], (score, key), key=lambda x: x[0])
                    best["metis"] = min(best["metis"], (t, key), key=lambda x: x[0])
    return best


@pytest.mark.parametrize("seed", range(4))
def test_vectorised_search_matches_brute_force_on_random_clusters(seed):
    rng = np.random.default_rng(seed)
    groups = []
    for i in range(int(rng.integers(2, 4))):
        count = int(rng.choice([1, 2, 4]))
        groups.append(
            group(
                f"g{i}",
                str(rng.choice(["nv", "amd"])),
                count=count,
                per_node=count,
                mem=float(rng.uniform(0.002, 0.02)),
                tflops=float(rng.uniform(50, 400)),
            )
        )
    cluster = cluster_from_dict({"cross_vendor_gbps": 5, "groups": groups})
    model = model_from_dict(TINY | {"layers": int(rng.integers(3, 7))})
    space = Space(cluster, model, 32, 8, (1, 2, 4))
    objective = Objective()
    brute = _brute_force(space, objective)
    result = search(space, objective, top=1)
    for name in ("memx", "metis"):
        want = brute[name][0]
        if not np.isfinite(want):
            assert result.top[name] == [] and result.binding
            continue
        got = result.top[name][0]
        assert (got.score if name == "memx" else got.time_s) == pytest.approx(want, rel=1e-9)


def test_recompute_is_chosen_where_memory_is_small():
    # one small and one large device group: only plans that recompute on the small one fit
    cluster = cluster_from_dict(
        {
            "cross_vendor_gbps": 5,
            "groups": [
                group("small", "nv", count=1, per_node=1, mem=0.0058),
                group("big", "amd", count=1, per_node=1, mem=1.0),
            ],
        }
    )
    space = Space(cluster, model_from_dict(TINY | {"layers": 3}), 512, 8, (4,))
    plan = search(space, Objective(), top=1).top["metis"][0]
    by_name = {g["group"]: g for g in plan.groups}
    assert by_name["small"]["recompute"] and not plan.oom


def test_objective_parse():
    assert Objective.parse("time+0.5*peak+2*var") == Objective(1.0, 0.5, 2.0)
    assert Objective.parse("time") == Objective(1.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="'memory'"):
        Objective.parse("time+memory")


def test_nothing_fits_names_memory():
    cluster = cluster_from_dict(
        {"cross_vendor_gbps": 5, "groups": [group("tiny", "nv", count=1, per_node=1, mem=1e-6)]}
    )
    result = search(Space(cluster, model_from_dict(TINY), 64, 4, (1,)), Objective())
    assert result.feasible == 0 and "memory" in result.binding
    assert all(v == [] for v in result.top.values())
    assert GIB == 1 << 30
