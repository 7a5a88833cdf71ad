"""vLLM's own offloading policies (``lru``, ``arc``) as HiState queue policies, for baselines.

vLLM 0.32's ``CachePolicy`` (vllm/v1/kv_offload/cpu/policies/) orders equal-sized chunks of
its CPU tier; the simulator's tiers hold KV blocks and snapshots of different sizes. This
adapter drives the real vLLM class: every item the queue holds is a chunk of the vLLM policy
(inserted ready, ``ref_cnt`` 0), each access the queue records (a larger ``last_access``) is a
``touch``, and victims are whatever ``evict(1, protected)`` returns, one at a time, until the
queue has room. The chunk capacity (which ARC's adaptation uses) is the number of items the
tier held the first time it filled. Nothing of either policy is re-implemented here.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from vllm.v1.kv_offload.base import ReqContext
from vllm.v1.kv_offload.cpu.policies.arc import ARCCachePolicy
from vllm.v1.kv_offload.cpu.policies.base import CachePolicy, ChunkStatus
from vllm.v1.kv_offload.cpu.policies.lru import LRUCachePolicy

from vllm_ext.histate.policy import Item, LruPolicy

_CONTEXT = ReqContext(req_id="histate-sim")


class VllmCachePolicy(LruPolicy):
    """A vLLM ``CachePolicy`` behind HiState's ``Policy`` interface (admits like ``lru``)."""

    static = False  # victims come from the vLLM class, not from a score
    vllm_cls: type[CachePolicy]

    def __init__(self, config):
        super().__init__(config)
        self._impl: CachePolicy | None = None
        self._seen: dict[str, float] = {}  # key -> last access the vLLM policy knows

    def order(self, items: Sequence[Item]) -> Iterator[Item]:
        if self._impl is None:
            self._impl = self.vllm_cls(max(1, len(items)))
        present = {item.key: item for item in items}
        self._forget_gone(present)
        fresh = sorted(
            (i for i in items if self._seen.get(i.key, -1.0) < i.last_access),
            key=lambda i: i.last_access,
        )
        for item in fresh:
            key = item.key.encode()
            if item.key in self._seen:
                self._impl.touch([key], _CONTEXT)
            else:
                self._impl.on_store_miss([key], _CONTEXT)
                chunk = ChunkStatus(len(self._seen))
                chunk.ref_cnt = 0  # stored and ready: evictable, as after a completed store
                self._impl.insert(key, chunk)
                self._impl.touch([key], _CONTEXT)
            self._seen[item.key] = item.last_access
        while True:
            victims = self._impl.evict(1, set())
            if not victims:
                return
            key = victims[0][0].decode()
            self._seen.pop(key, None)
            if key in present:
                yield present[key]

    def _forget_gone(self, present: dict[str, Item]) -> None:
        """Items that left the tier some other way (removed, pinned for a read) leave vLLM's too."""
        for key in [k for k in self._seen if k not in present]:
            del self._seen[key]
            if self._impl.get(key.encode()) is not None:
                self._impl.remove(key.encode())


class VllmLruPolicy(VllmCachePolicy):
    name = "vllm_lru"
    vllm_cls = LRUCachePolicy


class VllmArcPolicy(VllmCachePolicy):
    name = "vllm_arc"
    vllm_cls = ARCCachePolicy


VLLM_POLICIES = {cls.name: cls for cls in (VllmLruPolicy, VllmArcPolicy)}
