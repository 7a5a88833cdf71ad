"""Trace-driven discrete-event simulator of one serving instance with HiState's tiers.

It runs the very classes the connector uses (:class:`~vllm_ext.histate.tiers.TieredCache`,
:class:`~vllm_ext.histate.queue.EvictionQueue`, the policies and
:func:`~vllm_ext.histate.lookup.longest_hit`); only time and bytes are modelled
(:mod:`vllm_ext.histate.costmodel`).

Instance: prefills are served FCFS one at a time (a compute-bound prefill
batch has the same throughput); decodes run beside them and only decide when
a session's next turn arrives (closed loop: ``delay_s`` after the last token).
A request's TTFT = queueing + loading its hit (host KV blocks over PCIe, one
snapshot from its tier) + prefill of the tokens after the hit.

Device tier (every variant): vLLM's own hybrid prefix cache in align mode, one
LRU over KV blocks and snapshots (snapshots at prefill-chunk ends, the prompt
end and the decode end); blocks of running requests are pinned. Variants:

- ``native``: the device tier only;
- ``marconi_device``: Marconi as published, managing the device tier alone
  (its admission replaces vLLM's chunk/prompt-end snapshots; its eviction
  replaces the LRU);
- ``lru`` / ``marconi`` / ``histate``: plus host + SSD tiers under that policy.
  Every computed KV block is written through to host memory; snapshots the
  policy admits (every ``snapshot_interval_blocks``, prompt end, decode end,
  branch points) go to host memory and spill to the SSD.

``exact_end`` (issue 36 part 2, the hook for HiState's request-end "tail"
snapshots): at each request's end the tiers also get a *tail* item, the state
at exactly the tokens computed at finish (prompt + output - 1, not block
aligned) together with the KV of the partial last block (its bytes: one
snapshot + the partial block's KV). The session's next turn (previous prompt
+ output + new message) hits it when the KV of every full block before it is
present, so it recomputes only its new tokens (and the last sampled token,
which was never computed). A tail is keyed by the exact token stream it ends
(in a trace: the session and turn), priced like a snapshot: the tokens back
to the deepest block-aligned snapshot held.

Pricing: every store re-prices the request's whole chain (each held KV block and
snapshot up to the stored block gets the loss :func:`~vllm_ext.histate.lookup.
recompute_tokens` gives it over the snapshots held, and counts as accessed), so a
prefix block is never priced below a block that depends on it. ``connector_v1``
models HiState's connector before it did so (issue 36 part 3): a KV block priced
once, at its first store, by that request's prompt (``max(prompt blocks, j + 1)``
blocks of tokens), a snapshot by the blocks since the request's previous snapshot,
an item already held neither re-priced nor touched by a later store, and the
device copies of held snapshots released under every policy (the connector's
``release_device_snapshots`` does not look at the policy).
"""

from __future__ import annotations

import dataclasses
import heapq
from collections import deque
from typing import Any

import numpy as np

from vllm_ext.histate.config import HiStateConfig
from vllm_ext.histate.costmodel import CostModel
from vllm_ext.histate.lookup import (
    BranchTracker,
    longest_hit,
    recompute_tokens,
    snapshot_positions,
)
from vllm_ext.histate.policy import (
    Item,
    Kind,
    LruPolicy,
    MarconiPolicy,
    Policy,
    kv_key,
    snap_key,
)
from vllm_ext.histate.queue import EvictionQueue
from vllm_ext.histate.tiers import TieredCache
from vllm_ext.histate.traces import Trace, TraceRequest

VARIANTS = ("native", "marconi_device", "lru", "marconi", "histate")
# variants without host/SSD tiers
DEVICE_ONLY = ("native", "marconi_device")
_ARRIVE, _PREFILLED, _DECODED = 0, 1, 2


def tail_key(session_id: str, turn: int) -> str:
    """Store key of the tail snapshot at the exact end of ``turn`` of ``session_id``."""
    return f"tail:{session_id}/{turn}"


class InstanceSim:
    """One simulated instance running ``trace`` under ``variant``.

    Args:
        trace: requests (closed-loop per session).
        cost: timing and capacities; its ``host_bytes``/``ssd_bytes`` and
            calibration override the config's.
        variant: ``native`` or a policy name.
        config: HiState settings (time weight, alpha, interval, slack).
        policy_cls: replaces the variant's policy in the host/SSD tiers (ablations).
        exact_end: store tail snapshots at each request's exact end (module doc);
            only variants with host/SSD tiers have them. Default: the config's
            ``exact_end`` when it has one, else False.
        connector_v1: price and release as the connector did before chain pricing
            (module doc); reproduces the engine's HiState-vs-LRU recompute gap.
        release_all: release held snapshots' device copies under every tiered policy,
            as the connector does (default: under ``histate`` only, unless
            ``connector_v1``); always subject to ``release_device_snapshots``.
    """

    def __init__(
        self, trace: Trace, cost: CostModel, variant: str, config: HiStateConfig,
        policy_cls: type[Policy] | None = None, exact_end: bool | None = None,
        connector_v1: bool = False, release_all: bool | None = None,
    ):  # fmt: skip
        if variant not in VARIANTS:
            raise ValueError(f"unknown variant {variant!r}; expected one of {VARIANTS}")
        self.trace, self.cost, self.variant, self.B = trace, cost, variant, trace.block_size
        self.kv_bytes, self.state_bytes = cost.kv_block_bytes(self.B), cost.state_bytes
        policy = {"native": "lru", "marconi_device": "marconi"}.get(variant, variant)
        cfg = dataclasses.replace(
            config, policy=policy,
            host_bytes=cost.host_bytes, ssd_bytes=cost.ssd_bytes,
            prefill_s_per_token=cost.prefill_s_per_token,
            prefill_s_per_token2=cost.prefill_s_per_token2,
            ssd_read_bytes_per_s=cost.ssd_read_bytes_per_s,
            ssd_read_latency_s=cost.ssd_read_latency_s,
        )  # fmt: skip
        self.config = cfg
        if exact_end is None:
            exact_end = bool(getattr(config, "exact_end", False))
        self.exact_end = exact_end and variant not in DEVICE_ONLY
        self.connector_v1 = connector_v1
        release_all = connector_v1 if release_all is None else release_all
        self.release_device_snapshots = config.release_device_snapshots and (
            variant == "histate" or (release_all and variant not in DEVICE_ONLY)
        )
        # request -> deepest snapshot it stored or hit (connector_v1's snapshot price)
        self._last_snapshot: dict[tuple[str, int], int] = {}
        if variant == "marconi_device":
            # Marconi as published: its admission and eviction manage device memory
            self.device = EvictionQueue(MarconiPolicy(cfg), cost.device_bytes, cfg.evict_slack)
        else:
            self.device = EvictionQueue(LruPolicy(cfg), cost.device_bytes)
        policy = policy_cls(cfg) if policy_cls is not None else None
        ssd_policy = policy_cls(cfg) if policy_cls is not None else None
        self.tiers = (
            None if variant in DEVICE_ONLY
            else TieredCache(cfg, keep_payloads=False, policy=policy, ssd_policy=ssd_policy)
        )  # fmt: skip
        if self.tiers is not None:
            for queue in (self.tiers.host, self.tiers.ssd):
                # a policy that orders the whole tier, pinned items included (vLLM's lru/arc
                # behind benchmarks.histate.vllm_policies), is given its queue
                bind = getattr(queue.policy, "bind", None)
                if bind is not None:
                    bind(queue)
        # the prefix tree for Marconi's branch points
        self.branches = BranchTracker()
        self.stats: dict[str, float] = dict.fromkeys(
            ("hit_tokens", "prompt_tokens", "computed_tokens", "recomputed_tokens",
             "host_kv_read_bytes", "host_snapshot_read_bytes", "ssd_snapshot_read_bytes",
             "ssd_write_bytes", "spills_dropped", "device_insert_failures", "busy_s",
             "device_snapshots_released", "stores_skipped",
             "hits_device", "hits_host", "hits_ssd", "misses", "tail_hits",
             "tail_hit_tokens"), 0.0)  # fmt: skip
        self.ttft: list[float] = []
        # (session id, turn) -> blocks reused by that request
        self.hit_blocks: dict[tuple[str, int], int] = {}
        self._ssd_free_at = 0.0
        # device keys pinned by each running request (vLLM holds its blocks until it finishes)
        self._running: dict[tuple[str, int], list[str]] = {}

    def run(self) -> dict[str, Any]:
        """Simulate the whole trace; the metrics (see :func:`summarize`)."""
        sessions: dict[str, list[TraceRequest]] = {}
        for req in self.trace.requests:
            sessions.setdefault(req.session_id, []).append(req)
        events: list[tuple[float, int, int, Any]] = []
        seq = 0
        for turns in sessions.values():
            turns.sort(key=lambda r: r.turn)
            events.append((turns[0].arrival_s, seq, _ARRIVE, turns[0]))
            seq += 1
        heapq.heapify(events)
        waiting: deque[tuple[float, TraceRequest]] = deque()
        busy = False
        now = 0.0
        while events:
            now, _, kind, data = heapq.heappop(events)
            if kind == _ARRIVE:
                waiting.append((now, data))
            elif kind == _PREFILLED:
                req, arrival, hit_blocks, pins = data
                busy = False
                self.ttft.append(now - arrival)
                self._finish_prefill(req, hit_blocks, pins, now)
                decode_end = now + req.output_tokens * self.cost.decode_s_per_token
                heapq.heappush(events, (decode_end, seq, _DECODED, req))
                seq += 1
            else:
                self._finish_decode(data, now)
                turns = sessions[data.session_id]
                if data.turn + 1 < len(turns):
                    nxt = turns[data.turn + 1]
                    heapq.heappush(events, (now + nxt.delay_s, seq, _ARRIVE, nxt))
                    seq += 1
            if not busy and waiting:
                arrival, req = waiting.popleft()
                done, payload = self._start(req, arrival, now)
                heapq.heappush(events, (done, seq, _PREFILLED, payload))
                seq += 1
                busy = True
        return summarize(self, makespan=now)

    def _kv_tier(self, block_hash: str) -> str | None:
        key = kv_key(block_hash)
        if key in self.device:
            return "device"
        return self.tiers.tier_of(key) if self.tiers is not None else None

    def _snap_tier(self, block_hash: str) -> str | None:
        key = snap_key(block_hash)
        if key in self.device:
            return "device"
        return self.tiers.tier_of(key) if self.tiers is not None else None

    def _start(self, req: TraceRequest, arrival: float, now: float):
        P, B = req.prompt_tokens, self.B
        chain = req.blocks
        hit = longest_hit(chain, self._kv_tier, self._snap_tier, max_blocks=(P - 1) // B)
        hit_tokens = hit.blocks * B
        snapshot = snap_key(chain[hit.blocks - 1]) if hit.blocks else None
        snapshot_bytes = self.state_bytes
        tail = self._tail_hit(req, hit)
        if tail is not None and tail[0] > hit_tokens:
            hit_tokens, snapshot, tail_tier = tail
            snapshot_bytes = self.tiers.host.get(snapshot) or self.tiers.ssd.get(snapshot)
            snapshot_bytes = snapshot_bytes.nbytes
            # every full block before the tail is read, as a block hit of that depth would
            hit = longest_hit(chain, self._kv_tier, lambda h: tail_tier,
                              max_blocks=hit_tokens // B)  # fmt: skip
            hit = dataclasses.replace(hit, snapshot_tier=tail_tier)
            self.stats["tail_hits"] += 1
            self.stats["tail_hit_tokens"] += hit_tokens
        load = sum(self.kv_bytes for t in hit.kv_tiers if t == "host") / self.cost.h2d_bytes_per_s
        pins: list[str] = []
        if snapshot is not None:
            load += self._snapshot_read_seconds(hit.snapshot_tier, snapshot_bytes)
            tier_key = "ssd_snapshot_read_bytes" if hit.snapshot_tier == "ssd" else (
                "host_snapshot_read_bytes" if hit.snapshot_tier == "host" else None)  # fmt: skip
            if tier_key:
                self.stats[tier_key] += snapshot_bytes
            self.stats["host_kv_read_bytes"] += self.kv_bytes * hit.kv_tiers.count("host")
            self.stats[f"hits_{hit.snapshot_tier}"] += 1
            if self.tiers is not None:
                # a hit being read is pinned in its tier until the prefill ends
                for key in [snapshot] + [
                    kv_key(h) for h, t in zip(chain, hit.kv_tiers, strict=False) if t == "host"
                ]:
                    if self.tiers.pin(key):
                        pins.append(key)
                        self.tiers.touch(key, now)
        else:
            self.stats["misses"] += 1
        self._running[(req.session_id, req.turn)] = []
        self.hit_blocks[(req.session_id, req.turn)] = hit.blocks
        self._device_put(req, chain[: hit.blocks], (), now)
        compute = self.cost.prefill_seconds(P - hit_tokens, P)
        self.stats["hit_tokens"] += hit_tokens
        self.stats["prompt_tokens"] += P
        self.stats["computed_tokens"] += P - hit_tokens
        self.stats["recomputed_tokens"] += max(0, P - req.new_tokens - hit_tokens)
        self.stats["busy_s"] += load + compute
        return now + load + compute, (req, arrival, hit.blocks, pins)

    def _tail_hit(self, req: TraceRequest, hit) -> tuple[int, str, str] | None:
        """``(tokens, key, tier)`` of the previous turn's tail when it is usable, else None.

        Usable: the tail is in a tier and every full block before it has KV (the
        block hit's KV scan, ``hit.kv_blocks_present``, covers them).
        """
        if not self.exact_end or req.turn == 0:
            return None
        key = tail_key(req.session_id, req.turn - 1)
        tier = self.tiers.tier_of(key)
        tokens = req.prompt_tokens - req.new_tokens - 1  # computed at the previous finish
        if tier is None or tokens <= 0 or hit.kv_blocks_present < tokens // self.B:
            return None
        return tokens, key, tier

    def _snapshot_read_seconds(self, tier: str, nbytes: int) -> float:
        """Time to bring ``nbytes`` of one snapshot (or tail) from ``tier`` to the device."""
        if tier == "device":
            return 0.0
        if tier == "host":
            return nbytes / self.cost.h2d_bytes_per_s
        return self.cost.ssd_read_latency_s + nbytes / self.cost.ssd_read_bytes_per_s

    def _finish_prefill(self, req: TraceRequest, hit_blocks: int, pins: list[str], now: float):
        if self.tiers is not None:
            for key in pins:
                self.tiers.unpin(key)
        pb = req.prompt_tokens // self.B
        branch = self.branches.branch_point(req.blocks, pb)
        native = snapshot_positions(pb, max(1, self.cost.chunk_tokens // self.B), prompt_end=pb)
        if self.variant == "marconi_device":
            native = {branch: "branch"} if branch else {}
        ours = snapshot_positions(pb, self.config.snapshot_interval_blocks, prompt_end=pb,
                                  branch=branch)  # fmt: skip
        self._store(req, 0, pb, hit_blocks, native, ours, now)

    def _finish_decode(self, req: TraceRequest, now: float) -> None:
        pb, n = req.prompt_tokens // self.B, len(req.blocks)
        ours = snapshot_positions(n, self.config.snapshot_interval_blocks, decode_end=n)
        native = {n: "decode_end"} if n else {}
        # the block-aligned state "at the last decoded token" may lie inside the
        # prompt (no block boundary crossed while decoding): count from the hit
        self._store(req, pb, n, self.hit_blocks[(req.session_id, req.turn)], native, ours, now)
        if self.exact_end:
            self._store_tail(req, now)
        # the request's device blocks are released (vLLM frees them at finish)
        for key in self._running.pop((req.session_id, req.turn)):
            self.device.unpin(key)
        self._last_snapshot.pop((req.session_id, req.turn), None)

    def _store(self, req, first: int, upto: int, computed_from: int, native, ours, now):
        """Cache blocks ``first..upto-1`` and the snapshots the request produced."""
        chain = req.blocks
        self.branches.observe(chain, first, upto)
        new_native = [p for p in native if computed_from < p <= upto]
        self._device_put(req, chain[first:upto], [chain[p - 1] for p in new_native], now)
        if self.variant == "marconi_device":
            self._device_recompute(chain, upto, now)
        if self.tiers is None:
            return
        if self.connector_v1:
            self._store_first_priced(req, first, upto, computed_from, ours, now)
        else:
            self._store_chain_priced(req, upto, computed_from, ours, now)
        if self.release_device_snapshots:
            # the connector's device_pool: a held snapshot's device copy is released
            for p in new_native:
                key = snap_key(chain[p - 1])
                if self.tiers.tier_of(key) is not None and self.device.remove(key) is not None:
                    self.stats["device_snapshots_released"] += 1

    def _store_chain_priced(self, req, upto: int, computed_from: int, ours, now: float) -> None:
        """Store new items and re-price (touch) the held ones of ``req``'s chain up to ``upto``."""
        chain = req.blocks
        admitted = [p for p, why in ours.items() if computed_from < p <= upto
                    and self.tiers.admit(why)]  # fmt: skip
        have = [p for p in range(1, upto + 1) if self._snap_tier(chain[p - 1]) is not None]
        per_block, per_snap = recompute_tokens(upto, sorted(set(have) | set(admitted)), self.B)
        # tail first: at equal times the tail is evicted first, as in vLLM's free queue
        for j in reversed(range(upto)):
            self._tier_put(kv_key(chain[j]), Kind.KV, self.kv_bytes, now, per_block[j], j + 1)
        for p in sorted(per_snap, reverse=True):
            key = snap_key(chain[p - 1])
            if p in admitted or self.tiers.tier_of(key) is not None:
                self._tier_put(key, Kind.SNAPSHOT, self.state_bytes, now, per_snap[p], p)

    def _store_first_priced(self, req, first: int, upto: int, computed_from: int, ours, now):
        """``connector_v1``: store only what this request computed and no tier holds yet."""
        chain, bs = req.blocks, self.B
        supported = max((req.prompt_tokens - 1) // bs, 1)
        for j in range(max(first, computed_from), upto):
            key = kv_key(chain[j])
            if self.tiers.tier_of(key) is None:
                tokens = max(supported, j + 1) * bs
                self._tier_put(key, Kind.KV, self.kv_bytes, now, tokens, j + 1)
        request = (req.session_id, req.turn)
        for p in sorted(ours):
            key = snap_key(chain[p - 1])
            if not computed_from < p <= upto or self.tiers.tier_of(key) is not None:
                continue
            if not self.tiers.admit(ours[p]):
                continue
            previous = self._last_snapshot.get(request, computed_from)
            previous = previous if previous < p else 0
            self._last_snapshot[request] = p
            self._tier_put(key, Kind.SNAPSHOT, self.state_bytes, now, (p - previous) * bs, p)

    def _store_tail(self, req: TraceRequest, now: float) -> None:
        """The state at the exact end of ``req`` and its partial block's KV, as one item."""
        end = req.prompt_tokens + req.output_tokens - 1  # computed tokens at finish
        full = end // self.B
        partial = end - full * self.B
        if partial == 0:
            return  # block aligned: the decode-end snapshot is this state
        chain = req.blocks
        aligned = [p for p in range(1, full + 1) if self._snap_tier(chain[p - 1]) is not None]
        loss = end - (max(aligned) * self.B if aligned else 0)
        nbytes = self.state_bytes + partial * self.cost.kv_bytes_per_token
        self._tier_put(tail_key(req.session_id, req.turn), Kind.SNAPSHOT, nbytes, now, loss,
                       full, position=end)  # fmt: skip

    def _device_recompute(self, chain, upto: int, now: float) -> None:
        """Marconi on the device ranks items by FLOPs saved: give them recompute facts."""
        have = [p for p in range(1, upto + 1) if snap_key(chain[p - 1]) in self.device]
        per_block, per_snap = recompute_tokens(upto, have, self.B)
        for j in reversed(range(upto)):
            self.device.touch(kv_key(chain[j]), now, per_block[j], (j + 1) * self.B)
        for p, tokens in per_snap.items():
            self.device.touch(snap_key(chain[p - 1]), now, tokens, p * self.B)

    def _tier_put(
        self, key: str, kind: Kind, nbytes: int, now: float, tokens: int, pos: int,
        position: int | None = None,
    ):  # fmt: skip
        """Store (or touch) ``key``; it ends at block ``pos`` (or token ``position``)."""
        # an offer-count admission filter (vLLM's store_threshold, benchmarks.histate.vllm_policies)
        admit = getattr(self.tiers.host.policy, "admit_store", None)
        if admit is not None and not admit(key, self.tiers.tier_of(key) is not None):
            self.stats["stores_skipped"] += 1
            return
        position = pos * self.B if position is None else position
        result = self.tiers.store(key, kind, nbytes, now, recompute_tokens=tokens,
                                  position=position)  # fmt: skip
        for item in result.spilled:
            start = max(self._ssd_free_at, now)
            end = start + item.nbytes / self.cost.ssd_write_bytes_per_s
            if end - now > self.cost.ssd_max_backlog_s:
                # the write queue is full: the spill is dropped, a future miss
                self.tiers.remove(item.key)
                self.stats["spills_dropped"] += 1
                continue
            self._ssd_free_at = end
            self.stats["ssd_write_bytes"] += item.nbytes

    def _device_put(self, req: TraceRequest, blocks, snapshots, now: float) -> None:
        pinned = self._running[(req.session_id, req.turn)]
        for h in reversed(blocks):
            key = kv_key(h)
            if not self.device.touch(key, now):
                ok, _ = self.device.insert(Item(key, Kind.KV, self.kv_bytes, now))
                if not ok:
                    self.stats["device_insert_failures"] += 1
                    continue
            self.device.pin(key)
            pinned.append(key)
        for h in snapshots:
            key = snap_key(h)
            if not self.device.touch(key, now):
                ok, _ = self.device.insert(Item(key, Kind.SNAPSHOT, self.state_bytes, now))
                self.stats["device_insert_failures"] += 0 if ok else 1


def summarize(sim: InstanceSim, makespan: float) -> dict[str, Any]:
    """Latency percentiles, hit rates per tier, recompute and bytes per tier."""
    ttft = np.asarray(sim.ttft)
    s = sim.stats
    n = len(ttft)
    out: dict[str, Any] = {
        "requests": n,
        "ttft_p50_s": float(np.percentile(ttft, 50)) if n else None,
        "ttft_p90_s": float(np.percentile(ttft, 90)) if n else None,
        "ttft_p99_s": float(np.percentile(ttft, 99)) if n else None,
        "ttft_mean_s": float(ttft.mean()) if n else None,
        "token_hit_rate": s["hit_tokens"] / s["prompt_tokens"] if s["prompt_tokens"] else 0.0,
        "utilization": s["busy_s"] / makespan if makespan else 0.0,
        "makespan_s": makespan,
    }
    for tier in ("device", "host", "ssd"):
        out[f"hit_rate_{tier}"] = s[f"hits_{tier}"] / n if n else 0.0
    out["miss_rate"] = s["misses"] / n if n else 0.0
    for key in ("computed_tokens", "recomputed_tokens", "host_kv_read_bytes",
                "host_snapshot_read_bytes", "ssd_snapshot_read_bytes", "ssd_write_bytes",
                "spills_dropped", "device_insert_failures",
                "device_snapshots_released", "stores_skipped", "tail_hits",
                "tail_hit_tokens"):  # fmt: skip
        out[key] = s[key]
    if sim.tiers is not None:
        out["host_used_bytes"] = sim.tiers.host.used_bytes
        out["ssd_used_bytes"] = sim.tiers.ssd.used_bytes
        out["host_snapshots"] = sum(1 for i in sim.tiers.host if i.kind is Kind.SNAPSHOT)
        out["ssd_snapshots"] = len(sim.tiers.ssd)
    return out


def simulate(
    trace: Trace, cost: CostModel, variant: str, config: HiStateConfig | None = None,
    policy_cls: type[Policy] | None = None, exact_end: bool | None = None,
    connector_v1: bool = False,
):  # fmt: skip
    """Run one variant on ``trace`` (its tiers under ``policy_cls`` if given); its metrics."""
    config = config or HiStateConfig()
    return InstanceSim(trace, cost, variant, config, policy_cls, exact_end, connector_v1).run()


__all__ = ["VARIANTS", "InstanceSim", "simulate", "summarize", "tail_key"]
