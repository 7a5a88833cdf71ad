"""What vLLM's ``CPUOffloadingManager`` promises about its chunk slots, checked from outside.

Shared by the 0.32 unit tests (``from tests.histate_manager_checks import ...``),
the 0.34 tier and the swapped vLLM suites (bare ``import histate_manager_checks``:
both put ``tests/`` on the path). Reads the manager's own bookkeeping (private
attributes, the same on vLLM 0.32, 0.33 and 0.34), so a policy that loses a
chunk (a slot neither held nor free), frees one twice (a slot both held and
free, or free twice) or miscounts the evictable chunks shows up after any call.
"""

from __future__ import annotations


def manager_problems(manager) -> list[str]:
    """Broken slot invariants of ``manager`` (a vLLM ``CPUOffloadingManager``); [] if none."""
    policy = manager._policy
    held = policy_chunks(policy)
    held_ids = [chunk.chunk_id for chunk in held.values()]
    free = list(manager._free_list)
    allocated = manager._num_allocated_chunks
    problems = []
    if len(set(free)) != len(free):
        problems.append(f"a slot freed twice: free list {sorted(free)}")
    if len(set(held_ids)) != len(held_ids):
        problems.append(f"a slot held by two keys: {sorted(held_ids)}")
    if set(free) & set(held_ids):
        problems.append(f"slots both free and held: {sorted(set(free) & set(held_ids))}")
    if sorted([*free, *held_ids]) != list(range(allocated)):
        problems.append(
            f"leaked or foreign slots: held {sorted(held_ids)} + free {sorted(free)} "
            f"!= range({allocated})"
        )
    if len(held) > manager._num_chunks:
        problems.append(f"{len(held)} chunks held over capacity {manager._num_chunks}")
    evictable = sum(chunk.ref_cnt == 0 for chunk in held.values())
    if evictable != manager._num_evictable_cache_chunks:
        problems.append(
            f"evictable count {manager._num_evictable_cache_chunks}, ref_cnt 0 on {evictable}"
        )
    pending = sum(chunk.ref_cnt == -1 for chunk in held.values())
    if pending != manager._num_write_pending_chunks:
        problems.append(
            f"write-pending count {manager._num_write_pending_chunks}, ref_cnt -1 on {pending}"
        )
    return problems


def policy_chunks(policy) -> dict:
    """key -> ChunkStatus of every chunk ``policy`` holds (vLLM's lru/arc and HiState's)."""
    if hasattr(policy, "chunks"):
        return dict(policy.chunks)
    # vLLM's ARC keeps its resident chunks in two lists
    return {**policy.t1, **policy.t2}
