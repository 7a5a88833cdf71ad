"""On a GPU: HiState's page copies (pinned host buffer, side stream, events) round-trip exactly.

The same random layouts as the CPU test (tests/unit/test_histate_pages.py), with the KV tensors
on CUDA: a device tensor is never read through NumPy.
"""

from __future__ import annotations

from tests.histate_page_cases import check_store_evict_load


def test_store_overwrite_load_is_identical_on_cuda():
    check_store_evict_load("cuda")
