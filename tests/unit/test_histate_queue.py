"""HiState config, policies and the eviction queue: score formula, order, pinning, admission."""

from __future__ import annotations

import json
import random

import pytest

from vllm_ext.common.config import ConfigError
from vllm_ext.histate.config import (
    HiStateConfig,
    load_histate_config,
    reject_connector_extra_config,
)
from vllm_ext.histate.policy import (
    BRANCH,
    DECODE_END,
    INTERVAL,
    MIB,
    PROMPT_END,
    Item,
    Kind,
    LruPolicy,
    make_policy,
)
from vllm_ext.histate.queue import EvictionQueue

MB = 1 << 20


def test_config_env_block_and_defaults():
    env = {"VLLMEXT_HISTATE_POLICY": "marconi"}
    cfg = load_histate_config({"experimental": {"time_weight": 2}}, environ=env)
    assert cfg.policy == "marconi" and cfg.time_weight == 2.0
    assert load_histate_config(environ={}) == HiStateConfig()


def test_public_keys_are_the_tiers_policy_and_fsync():
    import dataclasses

    from vllm_ext.common.config import is_experimental

    public = {f.name for f in dataclasses.fields(HiStateConfig) if not is_experimental(f)}
    assert public == {"host_bytes", "ssd_bytes", "directory", "policy", "fsync",
                      "shared_group", "allow_unsafe_directory"}  # fmt: skip
    with pytest.raises(ConfigError, match=r"'time_weight' .* is experimental"):
        load_histate_config({"time_weight": 2}, environ={})


def test_connector_extra_config_is_refused_with_where_the_keys_moved():
    reject_connector_extra_config(None)
    reject_connector_extra_config({})
    extra = {"host_bytes": 1 << 20, "time_weight": 0.0}
    with pytest.raises(ConfigError) as err:
        reject_connector_extra_config(extra)
    message = str(err.value)
    assert "no longer reads kv_connector_extra_config" in message
    moved = message.split("--additional-config '", 1)[1].rstrip("'")
    # the message's replacement is a valid block with the same settings
    assert json.loads(moved) == {
        "histate": {"host_bytes": 1 << 20, "experimental": {"time_weight": 0.0}}
    }
    assert load_histate_config(json.loads(moved)["histate"], environ={}).time_weight == 0.0
    with pytest.raises(ConfigError, match=r"got \['dir'\]"):
        reject_connector_extra_config({"dir": "/tmp/x"})


@pytest.mark.parametrize(
    "field, value",
    [
        ("policy", "fifo"),
        ("host_bytes", -1),
        ("ssd_bytes", True),
        ("time_weight", float("nan")),
        ("prefill_s_per_token", 0.0),
        ("ssd_read_bytes_per_s", 0.0),
        ("ssd_read_latency_s", -1.0),
        ("snapshot_interval_blocks", 0),
        ("evict_slack", 0.9),
        ("directory", ""),
        ("fsync", "yes"),
    ],
)
def test_config_rejects_bad_values_naming_the_field(field, value):
    with pytest.raises(ConfigError, match=field):
        HiStateConfig(**{field: value})


def test_config_unknown_key():
    with pytest.raises(ConfigError, match="'weight'"):
        load_histate_config({"weight": 1.0}, environ={})


def test_recompute_seconds_has_linear_and_quadratic_terms():
    cfg = HiStateConfig(prefill_s_per_token=1e-3, prefill_s_per_token2=1e-6)
    # 10 tokens from 90 to 100: 10 * 1e-3 + 1e-6 * (100^2 - 90^2) / 2
    assert cfg.recompute_seconds(10, 100) == pytest.approx(0.01 + 1e-6 * 950)
    assert cfg.recompute_seconds(0, 100) == 0.0


def test_histate_score_is_clock_plus_loss_per_mib():
    cfg = HiStateConfig(
        time_weight=2.0, prefill_s_per_token=0.01, prefill_s_per_token2=0.0,
        ssd_read_bytes_per_s=4 * MB, ssd_read_latency_s=0.5,
    )  # fmt: skip
    policy = make_policy(cfg)
    kv = Item("a", Kind.KV, 4 * MB, last_access=10.0, recompute_tokens=100, position=100)
    # clock 3 + 2 * (100 tokens * 0.01 s) / 4 MiB; the wall-clock access time plays no part
    assert policy.score(kv, clock=3.0) == pytest.approx(3.0 + 2.0 * 1.0 / 4)
    snap = Item("s", Kind.SNAPSHOT, 4 * MB, last_access=10.0, recompute_tokens=100, position=100)
    # a snapshot that spills loses one SSD read (0.5 s + 4 MiB at 4 MiB/s), not its recompute
    assert policy.score(snap, clock=3.0, spills=True) == pytest.approx(3.0 + 2.0 * 1.5 / 4)
    assert policy.score(snap, clock=3.0, spills=False) == pytest.approx(3.0 + 2.0 * 1.0 / 4)
    assert MIB == MB


def test_histate_evicts_least_loss_per_byte_first():
    cfg = HiStateConfig(prefill_s_per_token=0.01, prefill_s_per_token2=0.0)
    q = EvictionQueue(make_policy(cfg), capacity=10 * MB)
    # loss per MiB: small 1 s, big 0.25 s, costly 10 s, cheap 0
    q.insert(Item("small", Kind.KV, 1 * MB, 5.0, recompute_tokens=100))
    q.insert(Item("big", Kind.SNAPSHOT, 4 * MB, 5.0, recompute_tokens=100))
    q.insert(Item("costly", Kind.KV, 1 * MB, 1.0, recompute_tokens=1000))
    q.insert(Item("cheap", Kind.KV, 1 * MB, 1.0))
    ok, evicted = q.insert(Item("new", Kind.KV, 6 * MB, 6.0))
    assert ok
    assert [i.key for i in evicted] == ["cheap", "big"]
    # the clock rose to the last victim's score: new items start from there
    assert q.clock == pytest.approx(0.25)
    q.check_invariants()


def test_histate_spilling_host_tier_evicts_snapshots_before_kv():
    # same bytes, same recompute: a snapshot that moves to the SSD loses a read, KV its prefill
    cfg = HiStateConfig(prefill_s_per_token=0.01, prefill_s_per_token2=0.0)
    q = EvictionQueue(make_policy(cfg), capacity=2 * MB, spills=True)
    q.insert(Item("snap", Kind.SNAPSHOT, MB, 2.0, recompute_tokens=100))
    q.insert(Item("kv", Kind.KV, MB, 1.0, recompute_tokens=100))
    _, evicted = q.insert(Item("x", Kind.KV, MB, 3.0, recompute_tokens=100))
    assert [i.key for i in evicted] == ["snap"]


def test_histate_clock_ages_costly_items_out():
    # GreedyDual: an untouched costly item goes once the clock passes its score
    cfg = HiStateConfig(prefill_s_per_token=0.01, prefill_s_per_token2=0.0)
    q = EvictionQueue(make_policy(cfg), capacity=2 * MB)
    q.insert(Item("costly", Kind.KV, MB, 0.0, recompute_tokens=300))  # score 3
    victims = []
    for n in range(6):
        _, evicted = q.insert(Item(f"c{n}", Kind.KV, MB, float(n), recompute_tokens=100))
        victims += [i.key for i in evicted]
    # each new item scores clock + 1, so the clock climbs by 1 per round and passes 3
    assert "costly" in victims and victims[0] != "costly"


def test_histate_order_does_not_depend_on_weight_or_time_origin():
    def victims(weight, t0):
        cfg = HiStateConfig(time_weight=weight, prefill_s_per_token=0.01, prefill_s_per_token2=0.0)
        q = EvictionQueue(make_policy(cfg), capacity=5 * MB)
        rng = random.Random(3)
        out = []
        for n in range(200):
            kind = Kind.KV if rng.random() < 0.5 else Kind.SNAPSHOT
            item = Item(n, kind, rng.choice((1, 2)) * MB, t0 + n,
                        recompute_tokens=rng.randrange(1, 500))  # fmt: skip
            out += [i.key for i in q.insert(item)[1]]
        return out

    assert victims(1.0, 0.0) == victims(50.0, 0.0) == victims(1.0, 1e9)


def test_time_weight_zero_is_lru():
    cfg = HiStateConfig(time_weight=0.0, prefill_s_per_token=0.01, prefill_s_per_token2=0.0)
    q = EvictionQueue(make_policy(cfg), capacity=2 * MB)
    q.insert(Item("costly", Kind.KV, 1 * MB, 1.0, recompute_tokens=10_000))
    q.insert(Item("recent", Kind.KV, 1 * MB, 2.0))
    _, evicted = q.insert(Item("x", Kind.KV, 1 * MB, 3.0))
    assert [i.key for i in evicted] == ["costly"]


def test_lru_order_and_touch_reorders():
    q = EvictionQueue(make_policy(HiStateConfig(policy="lru")), capacity=3 * MB)
    for t, key in enumerate("abc"):
        q.insert(Item(key, Kind.KV, MB, float(t)))
    assert q.touch("a", 10.0)
    _, evicted = q.insert(Item("d", Kind.KV, MB, 11.0))
    assert [i.key for i in evicted] == ["b"]
    assert not q.touch("zz", 1.0)


def test_pinned_items_are_never_evicted():
    q = EvictionQueue(make_policy(HiStateConfig(policy="lru")), capacity=2 * MB)
    q.insert(Item("old", Kind.KV, MB, 0.0))
    q.insert(Item("newer", Kind.KV, MB, 1.0))
    assert q.pin("old")
    _, evicted = q.insert(Item("x", Kind.KV, MB, 2.0))
    assert [i.key for i in evicted] == ["newer"]
    # everything else pinned too: the insert is refused and nothing is evicted
    q.pin("x")
    ok, evicted = q.insert(Item("y", Kind.KV, MB, 3.0))
    assert (ok, evicted) == (False, [])
    assert "old" in q and "x" in q
    q.unpin("old")
    ok, evicted = q.insert(Item("y", Kind.KV, MB, 3.0))
    assert ok and [i.key for i in evicted] == ["old"]
    q.check_invariants()


def test_item_larger_than_capacity_is_refused():
    q = EvictionQueue(make_policy(HiStateConfig()), capacity=MB)
    assert q.insert(Item("huge", Kind.SNAPSHOT, 2 * MB, 0.0)) == (False, [])
    assert len(q) == 0


def test_slack_evicts_below_capacity():
    q = EvictionQueue(make_policy(HiStateConfig(policy="lru")), capacity=10 * MB, slack=0.3)
    for t in range(10):
        q.insert(Item(t, Kind.KV, MB, float(t)))
    _, evicted = q.insert(Item("x", Kind.KV, MB, 99.0))
    # down to 7 MiB - 1 MiB before the insert
    assert len(evicted) == 4 and q.used_bytes == 7 * MB


def test_marconi_admission_and_normalised_order():
    cfg = HiStateConfig(policy="marconi", marconi_alpha=1.0, prefill_s_per_token2=0.0)
    policy = make_policy(cfg)
    assert policy.admit(BRANCH) and policy.admit(DECODE_END)
    assert not policy.admit(INTERVAL) and not policy.admit(PROMPT_END)
    assert make_policy(HiStateConfig(policy="histate")).admit(INTERVAL)
    with pytest.raises(ValueError, match="reason"):
        policy.admit("whim")
    items = [
        Item("old_efficient", Kind.SNAPSHOT, MB, 0.0, recompute_tokens=1000),
        Item("old_useless", Kind.SNAPSHOT, MB, 0.0, recompute_tokens=0),
        Item("recent_useless", Kind.SNAPSHOT, MB, 10.0, recompute_tokens=0),
    ]
    # S: old_efficient 0 + 1, old_useless 0 + 0, recent_useless 1 + 0
    assert [i.key for i in policy.order(items)][0] == "old_useless"
    q = EvictionQueue(policy, capacity=3 * MB)
    for item in items:
        q.insert(item)
    _, evicted = q.insert(Item("n", Kind.KV, MB, 11.0))
    assert [i.key for i in evicted] == ["old_useless"]


def test_random_operations_keep_invariants():
    rng = random.Random(0)
    for name in ("lru", "histate", "marconi"):
        q = EvictionQueue(make_policy(HiStateConfig(policy=name)), capacity=20 * MB, slack=0.05)
        pinned: set[int] = set()
        for step in range(2000):
            key = rng.randrange(60)
            op = rng.random()
            if op < 0.5:
                q.insert(Item(key, Kind.KV, rng.randint(1, 3) * MB, float(step),
                              recompute_tokens=rng.randrange(500)))  # fmt: skip
            elif op < 0.8:
                q.touch(key, float(step), rng.randrange(500))
            elif op < 0.9 and q.pin(key):
                pinned.add(key)
            elif pinned:
                q.unpin(pinned.pop())
            q.check_invariants()
            for key in pinned:
                assert key in q, f"{name}: pinned item {key} evicted"


def test_config_is_frozen_and_documented():
    import dataclasses

    from vllm_ext.common.config import config_table

    cfg = HiStateConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.time_weight = 3.0
    table = config_table(HiStateConfig, "histate")
    table += config_table(HiStateConfig, "histate", experimental=True)
    for f in dataclasses.fields(HiStateConfig):
        assert f.metadata["doc"] and f"`VLLMEXT_HISTATE_{f.name.upper()}`" in table


def test_a_restored_key_is_ranked_by_its_new_access_not_a_stale_heap_entry():
    # a re-stored item must not match heap entries of the item it replaced (their stamps
    # once restarted at 0, so the oldest entry's score came back: k1 went first at 12)
    q = EvictionQueue(LruPolicy(HiStateConfig()), capacity=4)
    q.insert(Item("k1", Kind.KV, 1, 1.0))
    q.touch("k1", 2.0)
    for t, key in ((3.0, "k2"), (4.0, "k3")):
        q.insert(Item(key, Kind.KV, 1, t))
    q.insert(Item("k1", Kind.KV, 1, 5.0))  # re-store
    q.insert(Item("k4", Kind.KV, 1, 6.0))
    _, evicted = q.insert(Item("k5", Kind.KV, 1, 7.0))
    assert [i.key for i in evicted] == ["k2"]
