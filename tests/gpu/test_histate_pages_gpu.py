"""On a GPU: HiState's page copies (pinned host buffer, side stream, events) round-trip exactly.

The same random layouts as the CPU test (tests/unit/test_histate_pages.py), with the KV tensors
on CUDA: a device tensor is never read through NumPy; and the worker's host tier on top of
them (tests/unit/test_histate_worker_store.py) round-trips through the SSD.
"""

from __future__ import annotations

from tests.histate_page_cases import check_batches, check_store_evict_load
from tests.unit.test_histate_worker_store import round_trip


def test_store_overwrite_load_is_identical_on_cuda():
    check_store_evict_load("cuda")


def test_batched_copies_equal_single_copies_on_cuda():
    # one side-stream section and one synchronization per batch
    check_batches("cuda")


def test_worker_store_spill_stage_load_is_identical_on_cuda(tmp_path):
    # the worker's host tier on CUDA: pinned host copies, SSD file, staged pinned copy
    for seed in range(4):
        round_trip(tmp_path, seed, "cuda")
