"""PageCopier on CPU: random layouts round-trip exactly; bad ids and sizes are refused."""

from __future__ import annotations

import pytest

from tests.histate_page_cases import check_batches, check_store_evict_load, random_caches
from vllm_ext.histate.pages import PageCopier, PageError


def test_store_overwrite_load_is_identical_on_cpu():
    check_store_evict_load("cpu")


def test_batched_copies_equal_single_copies_and_a_bad_payload_writes_nothing():
    check_batches("cpu")


def test_null_block_and_wrong_payload_are_refused():
    caches, groups, num_blocks = random_caches(0, "cpu")
    copier = PageCopier(caches, groups, num_blocks)
    with pytest.raises(PageError, match="outside"):
        copier.read(0, 0)
    with pytest.raises(PageError, match="expected"):
        copier.write(0, 1, b"x")
