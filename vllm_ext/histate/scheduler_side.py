"""The scheduler half of HiStateConnector: lookups, hit plans, store plans (no vLLM imports).

:class:`SchedulerSide` answers the connector's scheduler calls with
:class:`~vllm_ext.histate.runtime.HiStateRuntime` (the index) and builds each
step's metadata: tier operations the index decided, loads, stores, all by id.
vLLM objects (requests, scheduler output, block state, the metadata classes)
come from the connector and are read by attribute.

A hit whose snapshot is on the SSD is not offered at once: the worker first
stages the file into host memory (``stage``) and the request waits (``None``
from ``get_num_new_matched_tokens``, vLLM asks again next step). When the
worker reports it staged, the hit is offered and loaded from the staging
buffer; if the file was unreadable, the key leaves the index and the lookup
finds a shorter hit or a miss. So a load sent to the worker never fails.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm_ext.histate.config import HiStateConfig
from vllm_ext.histate.lookup import ROOT, tail_hash
from vllm_ext.histate.policy import DECODE_END, Kind, kv_key, snap_key, tail_kv_key, tail_snap_key
from vllm_ext.histate.pricing import chain_prices, held_snapshot_positions
from vllm_ext.histate.runtime import HOST, SSD, HiStateRuntime, LoadPlan, snapshot_reason
from vllm_ext.histate.worker_store import DROP, STAGE, UNSTAGE, LoadJob

if TYPE_CHECKING:
    from vllm_ext.histate.metadata import HiStateMetadata, HiStateWorkerMetadata


@dataclass(frozen=True)
class _Pending:
    """What a store sent to the worker needs once the worker reports it."""

    kind: Kind
    position: int
    recompute_tokens: int


# what else keys a request's tokens ``start..end`` (vLLM's block-hash extra keys); None
# when tails are off for this engine
TailExtra = Callable[[object, int, int], object] | None


class SchedulerSide:
    """Per-request bookkeeping of the scheduler half (one engine).

    ``tail_extra`` turns on tails: the state at each request's exact end (not
    block aligned) with the KV of its partial last block, stored when the
    request finishes (its blocks are freed once the worker has copied them),
    so the next turn of a conversation recomputes only its new tokens.
    """

    def __init__(
        self, config: HiStateConfig, runtime: HiStateRuntime, block_size: int,
        attn_group: int, mamba_group: int, tail_extra: TailExtra = None,
    ):  # fmt: skip
        self.config = config
        self.runtime = runtime
        self.counters = runtime.counters
        self.block_size = block_size
        self.attn_group = attn_group
        self.mamba_group = mamba_group
        self._requests: dict = {}
        self._branch: dict[str, int | None] = {}
        # request id -> (vLLM's local blocks, pinned plan)
        self._plans: dict[str, tuple[int, LoadPlan]] = {}
        self._loads: list[LoadJob] = []
        self._sent: list[LoadPlan] = []  # plans whose load this step carries (pinned until sent)
        self._inflight: dict[str, _Pending] = {}
        self._last_snapshot: dict[str, int] = {}
        # request id -> (stage id, key): asked of the worker / reported staged by it
        self._staging: dict[str, tuple[str, str]] = {}
        self._staged: dict[str, tuple[str, str]] = {}
        self._stage_seq = itertools.count()
        self._tail_extra = tail_extra
        # finish-time stores, and the requests whose blocks they hold until copied
        self._final_stores: list[tuple[str, int, int]] = []
        self._releases: list[str] = []
        self._tail_pending: dict[str, tuple[str, int, str]] = {}  # snapshot key -> tail
        # request id -> when its current hit was first planned (restore latency)
        self._hit_since: dict[str, float] = {}

    def on_new_request(self, request) -> None:
        self._requests[request.request_id] = request

    # ---- hits
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        req_id = request.request_id
        self._requests.setdefault(req_id, request)
        bs = self.block_size
        if num_computed_tokens % bs:
            return 0, False
        local = num_computed_tokens // bs
        cached = self._plans.get(req_id)
        if cached is not None and cached[0] == local and self._loadable(req_id, cached[1]):
            # asked again (e.g. no room this step): the plan is still pinned
            return cached[1].end(bs) - local * bs, False
        self._release_plan(req_id)
        # the last prompt token is always computed (it yields the first output token)
        max_blocks = (request.num_tokens - 1) // bs
        chain = [bytes(h).hex() for h in request.block_hashes[:max_blocks]]
        if req_id not in self._branch:
            self._branch[req_id] = self.runtime.branches.branch_point(chain, len(chain))
            self.runtime.branches.observe(chain)
        tails = self._tails_of(request, chain) if self._tail_extra is not None else None
        plan = self.runtime.plan_load(chain, local, max_blocks, tails, bs)
        if plan is None:
            self._unstage(req_id)
            return 0, False
        self.runtime.pin(plan)
        self._plans[req_id] = (local, plan)
        self._hit_since.setdefault(req_id, time.monotonic())
        if plan.snapshot_tier == HOST:
            self._unstage(req_id)
            return plan.end(bs) - local * bs, False
        if self._loadable(req_id, plan):
            return plan.end(bs) - local * bs, False
        if self._staging.get(req_id, ("", ""))[1] != plan.snapshot_key:
            self._unstage(req_id)
            stage_id = f"{req_id}#{next(self._stage_seq)}"
            self._staging[req_id] = (stage_id, plan.snapshot_key)
            self.runtime.queue_op((STAGE, plan.snapshot_key, stage_id))
        return None, False  # vLLM asks again once the worker has read the file

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        cached = self._plans.pop(request.request_id, None)
        if cached is None:
            return
        local, plan = cached
        if num_external_tokens == 0:
            self.runtime.unpin(plan)
            return
        end = plan.end(self.block_size)
        if num_external_tokens != end - local * self.block_size:
            raise RuntimeError(
                f"HiState: vLLM allocated {num_external_tokens} external tokens for "
                f"{request.request_id}, the plan covers {end - local * self.block_size}"
            )
        block_ids = blocks.get_block_ids()
        # a tail's partial KV goes into block ``blocks``, after the full ones
        last = plan.blocks + (plan.tail_kv_key is not None)
        attn = block_ids[self.attn_group][local:last]
        kv_keys = plan.keys()[:-1]
        mamba = block_ids[self.mamba_group]
        # align mode: the state after ``end`` tokens lives in block ``(end - 1) // bs``
        # and, before the forward (and before start_load_kv), vLLM copies it into the
        # request's running-state block (the last one) when that is another: fill both
        source = (end - 1) // self.block_size
        if len(mamba) > source + 1:
            state_blocks = (mamba[source], mamba[-1])
        else:
            state_blocks = (mamba[source],) if plan.tail_kv_key and len(mamba) > source else (0,)
        if len(attn) != len(kv_keys) or 0 in attn or 0 in state_blocks:
            raise RuntimeError(
                f"HiState: unexpected blocks for a {plan.blocks}-block hit of "
                f"{request.request_id}: attention {attn}, recurrent {mamba}"
            )
        stage_id = ""
        if plan.snapshot_tier != HOST:
            stage_id = self._staged.pop(request.request_id)[0]  # the load frees the buffer
        self._loads.append(
            LoadJob(request.request_id, list(zip(attn, kv_keys, strict=True)),
                    state_blocks, plan.snapshot_key, stage_id)
        )  # fmt: skip
        self._sent.append(plan)
        self._last_snapshot[request.request_id] = end // self.block_size
        self.runtime.record_hit(plan, self.block_size)
        since = self._hit_since.pop(request.request_id, None)
        if since is not None:
            self.counters.observe("restore_seconds", time.monotonic() - since)

    def _loadable(self, req_id: str, plan: LoadPlan) -> bool:
        staged = self._staged.get(req_id)
        return plan.snapshot_tier == HOST or (staged is not None and staged[1] == plan.snapshot_key)

    def _release_plan(self, req_id: str) -> None:
        cached = self._plans.pop(req_id, None)
        if cached is not None:
            self.runtime.unpin(cached[1])

    def _unstage(self, req_id: str) -> None:
        for table in (self._staging, self._staged):
            entry = table.pop(req_id, None)
            if entry is not None:
                self.runtime.queue_op((UNSTAGE, entry[1], entry[0]))

    # ---- the step's metadata
    def build_connector_meta(self, scheduler_output, meta: HiStateMetadata) -> HiStateMetadata:
        """Fill ``meta`` (a fresh :class:`HiStateMetadata`) for this step."""
        meta.loads, self._loads = self._loads, []
        meta.final_stores, self._final_stores = self._final_stores, []
        meta.releases, self._releases = self._releases, []
        state = scheduler_output.kv_connector_block_state
        if state is not None:
            for req_id, n in scheduler_output.num_scheduled_tokens.items():
                self._plan_stores(meta, state, req_id, n)
            for req_id, offers in state.boundary_state_offloads.items():
                request = self._requests.get(req_id)
                if request is None:
                    continue
                for group_id, block_id, boundary_tokens in offers:
                    if group_id == self.mamba_group and boundary_tokens % self.block_size == 0:
                        self._plan_snapshot_store(meta, request, block_id, boundary_tokens)
        # drops decided from now on go out after these loads: the plans need no pin
        meta.ops = self.runtime.take_ops()
        for plan in self._sent:
            self.runtime.unpin(plan)
        self._sent = []
        for tier, queue in ((HOST, self.runtime.tiers.host), (SSD, self.runtime.tiers.ssd)):
            self.counters.set("tier_used_bytes", queue.used_bytes, tier)
            self.counters.set("tier_capacity_bytes", queue.capacity, tier)
        return meta

    def _plan_stores(self, meta: HiStateMetadata, state, req_id: str, n: int) -> None:
        """KV blocks this step fills, and the state if the step ends on a block boundary."""
        request = self._requests.get(req_id)
        if request is None:
            return
        bs = self.block_size
        before, after = request.num_computed_tokens, request.num_computed_tokens + n
        first, last = before // bs, min(after // bs, len(request.block_hashes))
        if last <= first:
            return
        block_ids = state.get_block_ids(req_id)
        if block_ids is None:
            return
        ids = block_ids[self.attn_group]
        # a KV block is worth what its loss costs: the hits through it (pricing.py)
        prices = self._reprice_chain(request, last, after % bs == 0 and after // bs == last)
        for j in range(first, min(last, len(ids))):
            key = kv_key(bytes(request.block_hashes[j]).hex())
            if ids[j] == 0 or key in self._inflight or self.runtime.has(key):
                continue
            meta.stores.append((key, self.attn_group, ids[j]))
            self._inflight[key] = _Pending(Kind.KV, (j + 1) * bs, prices.get(key, 0))
        if after % bs == 0 and after // bs == last:
            # align mode keeps the running state of a step ending at token k*bs in the
            # block of index k-1; after the forward it is exactly the boundary state.
            # vLLM offers only some of these (none while decoding), so take them here.
            mamba = block_ids[self.mamba_group]
            if len(mamba) >= last:
                self._plan_snapshot_store(meta, request, mamba[last - 1], after)

    def _reprice_chain(
        self, request, upto: int, boundary_state: bool, tail: bool = False
    ) -> dict[str, int]:
        """Re-price (and touch) the held items of ``request``'s chain up to block ``upto``.

        Prices come from the snapshots held, in flight, or (``boundary_state``) about to be
        stored at ``upto``, so a prefix block is never priced below a block that depends on
        it (pricing.py: priced once at the first store, interior blocks were evicted before
        their useless descendants). Returns the price of every key of the chain.
        """
        bs = self.block_size
        chain = [bytes(h).hex() for h in request.block_hashes[:upto]]
        snapshots = set(held_snapshot_positions(
            chain, upto, lambda key: key in self._inflight or self.runtime.has(key)))  # fmt: skip
        if boundary_state and upto >= 1:
            reason = snapshot_reason(upto, request.num_prompt_tokens, bs,
                                     self.config.snapshot_interval_blocks,
                                     self._branch.get(request.request_id))  # fmt: skip
            if self.runtime.admit(reason):
                snapshots.add(upto)
        if tail and upto >= 1:
            # a tail after block `upto` needs every block before it: price them as a
            # snapshot there would (the tail's own tokens are priced by its items)
            snapshots.add(upto)
        now = self.runtime.now()
        prices: dict[str, int] = {}
        for key, tokens, position in chain_prices(chain, upto, bs, snapshots):
            prices[key] = tokens
            self.runtime.tiers.touch(key, now, tokens, position)
        return prices

    def _plan_snapshot_store(self, meta, request, block_id: int, boundary_tokens: int) -> None:
        k = boundary_tokens // self.block_size
        if not 0 < k <= len(request.block_hashes) or block_id == 0:
            return
        req_id = request.request_id
        key = snap_key(bytes(request.block_hashes[k - 1]).hex())
        if key in self._inflight or self.runtime.has(key):
            return
        reason = snapshot_reason(
            k, request.num_prompt_tokens, self.block_size,
            self.config.snapshot_interval_blocks, self._branch.get(req_id),
        )  # fmt: skip
        if reason is None:
            return
        if not self.runtime.admit(reason):
            self.counters.inc("store_rejected")
            return
        previous = self._last_snapshot.get(req_id, 0)
        previous = previous if previous < k else 0
        self._last_snapshot[req_id] = k
        meta.stores.append((key, self.mamba_group, block_id))
        self._inflight[key] = _Pending(
            Kind.SNAPSHOT, boundary_tokens, (k - previous) * self.block_size
        )

    # ---- what the worker reports
    def update_connector_output(self, meta: HiStateWorkerMetadata) -> None:
        for key, nbytes in meta.stored.items():
            info = self._inflight.pop(key, None)
            if info is None:
                self.runtime.queue_op((DROP, key, ""))  # nobody asked: free the copy
                continue
            indexed = self.runtime.stored(
                key, info.kind, nbytes, info.position, info.recompute_tokens
            )
            tail = self._tail_pending.pop(key, None)
            if tail is not None and indexed:
                self.runtime.add_tail(*tail)
        for key in meta.failed:
            self._inflight.pop(key, None)
            self._tail_pending.pop(key, None)
            self.counters.inc("store_failures")
        for stage_id, key in meta.staged:
            req_id = stage_id.rsplit("#", 1)[0]
            if self._staging.get(req_id) == (stage_id, key):
                self._staged[req_id] = self._staging.pop(req_id)
            # else: unstaged meanwhile; the worker frees it in order
        for stage_id, key in meta.stage_failed:
            req_id = stage_id.rsplit("#", 1)[0]
            if self._staging.get(req_id) == (stage_id, key):
                del self._staging[req_id]
            self.runtime.unreadable(key)
        for key, code, nbytes in meta.spill_failed:
            self.runtime.spill_failed(key, code, nbytes)

    def request_finished(self, request, block_ids=None) -> bool:
        """Forget the request; True if its blocks must wait for a finish-time copy."""
        req_id = request.request_id
        held = block_ids is not None and self._plan_tail_store(request, block_ids)
        self._release_plan(req_id)
        self._unstage(req_id)
        for table in (self._requests, self._branch, self._last_snapshot, self._hit_since):
            table.pop(req_id, None)
        return held

    # ---- tails
    def _tail_name(self, request, chain: list[str], depth: int, length: int) -> str:
        start = depth * self.block_size
        parent = chain[depth - 1] if depth else ROOT
        tokens = request.all_token_ids[start : start + length]
        return tail_hash(parent, tokens, self._tail_extra(request, start, start + length))

    def _tails_of(self, request, chain: list[str]):
        """Candidate tails of ``request`` after each depth, ending before its last token."""

        def at(depth: int) -> list[tuple[int, str]]:
            parent = chain[depth - 1] if depth else ROOT
            room = request.num_tokens - 1 - depth * self.block_size
            lengths = [n for n in self.runtime.tails.lengths(parent) if n <= room]
            return [(n, self._tail_name(request, chain, depth, n)) for n in lengths]

        return at

    def _plan_tail_store(self, request, block_ids) -> bool:
        """Copy the state at the request's exact end and its partial KV block, once.

        Only when no later token was forwarded (vLLM's rule for a finish-time
        Mamba source: under async scheduling a step in flight moves the state on).
        """
        if self._tail_extra is None:
            return False
        end = request.num_computed_tokens
        depth, length = divmod(end, self.block_size)
        if (
            length == 0  # block aligned: the boundary snapshot covers it
            or getattr(request, "num_in_flight_tokens", 0)
            or end > len(request.all_token_ids)
            or depth > len(request.block_hashes)
        ):
            return False
        attn, mamba = block_ids[self.attn_group], block_ids[self.mamba_group]
        if len(attn) <= depth or len(mamba) <= depth or not attn[depth] or not mamba[depth]:
            return False
        chain = [bytes(h).hex() for h in request.block_hashes[:depth]]
        name = self._tail_name(request, chain, depth, length)
        snap, kv = tail_snap_key(name), tail_kv_key(name)
        if snap in self._inflight or (self.runtime.has(snap) and self.runtime.has(kv)):
            return False
        if not self.runtime.admit(DECODE_END):
            self.counters.inc("store_rejected")
            return False
        self._reprice_chain(request, depth, boundary_state=False, tail=True)
        previous = self._last_snapshot.get(request.request_id, 0) * self.block_size
        recompute = max(end - previous, 1)
        self._final_stores += [(kv, self.attn_group, attn[depth]),
                               (snap, self.mamba_group, mamba[depth])]  # fmt: skip
        self._inflight[kv] = _Pending(Kind.KV, end, recompute)
        self._inflight[snap] = _Pending(Kind.SNAPSHOT, end, recompute)
        self._tail_pending[snap] = (chain[depth - 1] if depth else ROOT, length, name)
        self._releases.append(request.request_id)
        return True

    def idle_state(self) -> dict[str, int]:
        """Sizes of per-request bookkeeping (all 0 once no request is live; tests)."""
        return {
            "requests": len(self._requests),
            "plans": len(self._plans),
            "loads": len(self._loads),
            "inflight": len(self._inflight),
            "staging": len(self._staging) + len(self._staged),
            "hits_waiting": len(self._hit_since),
        }
