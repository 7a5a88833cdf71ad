"""vLLM's own P/D connector-lifecycle tests with ArkConnector in NIXL's place (0.32 and 0.34).

``test_remote_prefill_lifecycle.py`` and ``test_remote_decode_lifecycle.py``
drive a real ``Scheduler`` through P/D requests' lives and end with vLLM's leak
check (``assert_scheduler_empty``); :mod:`swap_ark` builds ARK's connector where
they build NIXL's. Every test that passes stock must pass with ARK, except the
differences listed here with their reason. Stock outcomes are static: all of
these files' tests pass stock on both releases here.
"""

from __future__ import annotations

import pytest
from runner import PASSED, run_suite

UNIT = "tests/v1/kv_connector/unit/"
FILES = [UNIT + "test_remote_prefill_lifecycle.py", UNIT + "test_remote_decode_lifecycle.py"]
# tests collected per release (each passes stock)
COLLECTED = {"0.32.0": 20, "0.34.0": 25}
HYBRID = (
    "hybrid KV cache (several groups / Mamba): ArkConnector supports one attention group and "
    "is not SupportsHMA, so vLLM's factory refuses it"
)
NIXL_PARAMS = (
    "reads NIXL's kv_transfer_params (remote_block_ids); ARK's prefill returns "
    "{transfer_id, ark_port}"
)
EXPECTED_DIFFERENCES = {
    UNIT + "test_remote_decode_lifecycle.py::test_short_prompt_lifecycle": NIXL_PARAMS,
    UNIT + "test_remote_decode_lifecycle.py::test_prefix_cache_lifecycle": NIXL_PARAMS,
    UNIT + "test_remote_prefill_lifecycle.py::test_p_side_chunked_prefill_mamba": HYBRID,
    **{
        UNIT + f"test_remote_prefill_lifecycle.py::{name}": HYBRID
        for name in (
            "test_async_load_does_not_double_reserve_mamba_spec_blocks[align-16-18]",
            "test_async_load_does_not_double_reserve_mamba_spec_blocks[none-128-18]",
            "test_async_load_reserves_blocks_for_promotion_margin[different-block-sizes]",
            "test_async_load_reserves_blocks_for_promotion_margin[multiple-groups]",
            "test_async_load_reserves_blocks_for_promotion_margin[single-group]",
        )
    },
}


@pytest.mark.parametrize("version", sorted(COLLECTED))
def test_ark_passes_vllms_pd_lifecycle_tests(version, tmp_path):
    outcomes = run_suite(version, FILES, "ark", tmp_path)
    assert len(outcomes) == COLLECTED[version], sorted(outcomes)
    failed = {node for node, outcome in outcomes.items() if outcome != PASSED}
    assert failed == set(EXPECTED_DIFFERENCES), (
        f"unexpected: {sorted(failed - set(EXPECTED_DIFFERENCES))}; "
        f"listed but passing: {sorted(set(EXPECTED_DIFFERENCES) - failed)}"
    )
