"""vLLM's own CPU-offloading tests with HiState's CachePolicy where they pick lru or arc.

Runs ``tests/v1/kv_offload/cpu/test_manager.py`` and ``policies/test_factory.py``
of vLLM 0.32 and 0.34 (the files of ``tests/v1/kv_offload/cpu/`` that
touch the manager or its policies and run on a CPU; the others copy blocks on
a GPU or size the CPU tier) in a subprocess, with :mod:`swap_histate`: every
``CPUOffloadingManager`` built with ``"lru"`` or ``"arc"`` holds
``HiStateCachePolicy``, and after each manager call the slot checks of
:mod:`histate_manager_checks` run (no chunk leaked, none freed twice, counts
right). Every test that passes stock must pass swapped, except
:data:`EXPECTED_DIFFERENCES`, each of which must still fail (so the list stays
true).
"""

from __future__ import annotations

import pytest
from runner import FAILED, PASSED, run_suite

MANAGER = "tests/v1/kv_offload/cpu/test_manager.py"
FILES = [MANAGER, "tests/v1/kv_offload/cpu/policies/test_factory.py"]
ARC_CLASS = "tests/v1/kv_offload/cpu/test_manager/TestARCPolicy.py"  # junit's node id form

# stock runs of FILES (no swap), recorded once: how many tests, which failed and why
# (0.33.0, 76 tests, all pass stock, gave the same differences; ~3 min a release: not run)
STOCK_TESTS = {"0.32.0": 59, "0.34.0": 80}
STOCK_FAILURES: dict[str, dict[str, str]] = {"0.32.0": {}, "0.34.0": {}}

_ARC = "asserts the policy is vLLM's ARCCachePolicy and reads its T1/T2/ghost lists or target"
_LRU = "asserts the policy is vLLM's LRUCachePolicy and reads its lazy heap"
EXPECTED_DIFFERENCES: dict[str, str] = {
    **{
        f"{ARC_CLASS}::{name}": _ARC
        for name in (
            "test_adaptive_target", "test_basic", "test_batch_eviction_failure_is_atomic",
            "test_batch_eviction_falls_back_after_t1_iterator_exhausted",
            "test_batch_eviction_scans_t1_and_t2_once", "test_eviction_with_load",
            "test_failed_store", "test_full_scenario", "test_ghost_list_bounds",
            "test_reuse_ordering", "test_t1_t2_eviction_policy", "test_t1_to_t2_promotion",
            "test_touch_ordering",
            *(
                "test_store_falls_back_to_t1_when_t2_cannot_satisfy_eviction"
                f"[pinned{i}-protected{i}-new_keys{i}-{expected}]"
                for i, expected in enumerate([*(f"expected_evicted{j}" for j in range(5)), "None"])
            ),
        )
    },  # fmt: skip
    **{
        f"{MANAGER}::{name}": _ARC
        for name in (
            "test_arc_counts_reuse_once_and_keeps_insertions_in_t1",
            "test_arc_ghost_hit_adapts_once_per_request_before_insertion",
            "test_arc_pending_chunk_is_not_a_frequency_hit",
            "test_arc_reuse_wins_if_same_request_later_reinserts_key",
            "test_reset_discards_stale_request_access_classification",
        )
    },
    f"{MANAGER}::test_lru_batch_eviction_failure_is_atomic": _LRU
    + " (atomic refusal: tests/unit and tests/vllm034 test_histate_cache_policy.py)",
    f"{MANAGER}::test_lru_repeated_pin_cycles_compact_lazy_heap_entries": _LRU,
    f"{MANAGER}::test_cpu_manager": (
        "asserts LRU's store order among chunks of one shared context with no positions "
        "(evicts 4 before 5); HiState takes their order in the request as the prefix and "
        "evicts its tail 5 first, which loses one chunk where 4 loses two"
    ),
    f"{MANAGER}::test_store_threshold_does_not_hide_ready_reuse": (
        "asserts LRU recency: the tail reused alone outlives the head; HiState keeps the "
        "head, whose loss is the whole two-chunk prefix, over the tail's one chunk"
    ),
}


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    return tmp_path_factory.mktemp("histate-suite")


@pytest.mark.parametrize("version", sorted(STOCK_TESTS))
def test_vllms_offloading_suite_passes_with_histates_policy(version, hub):
    outcomes = run_suite(version, FILES, "histate", hub / version)
    # the suite really ran, in full (a collection error would shrink it)
    assert len(outcomes) == STOCK_TESTS[version], sorted(outcomes)
    stock_failures = STOCK_FAILURES[version]
    regressions = [
        node
        for node, outcome in sorted(outcomes.items())
        if outcome != PASSED and node not in stock_failures and node not in EXPECTED_DIFFERENCES
    ]
    assert not regressions, f"vLLM {version}: failed with HiState's policy: {regressions}"
    # each expected difference still differs where it exists in this release
    stale = [
        node
        for node in EXPECTED_DIFFERENCES
        if node in outcomes and outcomes[node] != FAILED and node not in stock_failures
    ]
    assert not stale, f"vLLM {version}: no longer differ, drop them from the list: {stale}"
