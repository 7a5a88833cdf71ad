"""vLLM's own scheduler suite with LEAP's scheduler and connector swapped in (swap_leap).

Runs ``tests/v1/core/test_scheduler.py`` of vLLM 0.32 and 0.34 in a subprocess
(:mod:`runner`), every scheduler the suite's ``create_scheduler`` builds being
LEAP's (see :mod:`swap_leap`, which also audits each one: no lost request, no
leaked or doubly freed block). Every test that passes stock must pass swapped,
except the expected differences below, each with its reason. The stock outcomes
are not rerun: the tests that fail stock are listed with the reason.
"""

from __future__ import annotations

import pytest

from tests.vllm_suites.runner import FAILED, PASSED, run_suite

SUITE = "tests/v1/core/test_scheduler.py"

# fail stock on this host: each builds a llava (multimodal) model config, and no such
# model is available offline (pydantic ValidationError "Invalid repository ID")
_MULTIMODAL_BOTH = {
    "test_eagle3_mm_encoder_cache_with_shift",
    "test_ec_connector_allocate_encoder_tokens_with_external_load",
    "test_ec_connector_cache_hit_external_load",
    "test_ec_connector_cache_miss_computes_locally",
    "test_ec_connector_defers_running_request_for_async_reload",
    "test_ec_connector_ensure_cache_available_defers_request",
    "test_ec_connector_schedule_multiple_requests",
    "test_ec_connector_text_only_request",
    "test_ec_connector_unable_to_allocate",
    "test_ec_connector_update_connector_output_called",
    "test_ec_connector_with_partial_cache_hit_multi_round",
    "test_encoder_cache_accepts_matching_embed_count",
    "test_encoder_cache_embed_count_mismatch_restores_prior_hit_state",
    "test_encoder_cache_recomputed_when_evicted_during_preemption",
    "test_encoder_cache_rejects_mismatched_embed_count",
    "test_encoder_cache_rejects_mismatched_embed_count_within_request",
    "test_encoder_cache_retained_across_preemption_and_resume",
    "test_encoder_only_prompt_longer_than_budget_is_chunked",
    "test_free_encoder_inputs_notifies_the_ec_connector",
    "test_free_encoder_inputs_respects_unconfirmed_placeholders",
    "test_free_encoder_inputs_unchanged_without_spec_decode",
    "test_no_mm_input_chunking",
    "test_no_mm_input_chunking_for_same_step_duplicate",
    "test_priority_scheduling_ec_connector_preemption_and_resumption",
    "test_same_step_duplicate_encoder_input_stays_cached",
    "test_schedule_multimodal_requests",
    "test_schedule_partial_requests",
    "test_unavailable_encoder_input_fails_the_request_as_retryable",
}
_MULTIMODAL_034 = {
    "test_cpu_encoder_input_updates_preserve_shm_handles",
    "test_cpu_encoder_input_updates_restore_after_kv_load_failure",
    "test_cpu_encoder_input_updates_resume_and_abort",
    "test_cpu_encoder_input_updates_wait_for_completed_prefill",
    "test_ec_connector_waits_for_embeddings_in_prefix_replay",
    "test_encoder_cache_pressure_respects_disabled_chunked_prefill",
    "test_no_mm_input_chunking_after_prefix_cache_hit_inside_item",
    "test_no_mm_input_chunking_at_item_boundary",
    "test_waiting_encoder_stall_does_not_starve_later_requests",
    "test_waiting_encoder_stall_is_counted_as_deferred",
    "test_waiting_encoder_stall_kv_holder_keeps_drain_priority",
}
_MULTIMODAL_032 = {"test_free_encoder_inputs_defers_for_eagle_lookahead"}
MULTIMODAL_UNAVAILABLE = "needs a llava model, unavailable offline"
STOCK_FAILURES = {
    "0.32.0": dict.fromkeys(_MULTIMODAL_BOTH | _MULTIMODAL_032, MULTIMODAL_UNAVAILABLE),
    "0.34.0": dict.fromkeys(_MULTIMODAL_BOTH | _MULTIMODAL_034, MULTIMODAL_UNAVAILABLE),
}
# tests the suite holds per release (a shrunken run means the suite did not run whole)
NUM_TESTS = {"0.32.0": 208, "0.34.0": 303}

# pass stock, fail swapped, for a reason that is not a LEAP fault (by test function)
_READS_TEST_CONNECTOR_METADATA = (
    "reads `.requests` of scheduler_output.kv_connector_metadata (its test connector's "
    "metadata shape, asserted in vLLM's _step_until_done whenever a connector is "
    "configured): under the swap that is MultiConnector's metadata, or LEAP's"
)
_PATCHES_CONNECTOR_LOOKUP = (
    "patches scheduler.connector.get_num_new_matched_tokens: under the swap that is the "
    "MultiConnector, whose other hooks then find no child recorded for the request "
    "(KeyError)"
)
_COMMON_DIFFERENCES = {
    "test_kv_connector_basic": _READS_TEST_CONNECTOR_METADATA,
    "test_external_prefix_cache_metrics": _READS_TEST_CONNECTOR_METADATA,
    "test_kv_connector_unable_to_allocate": _READS_TEST_CONNECTOR_METADATA,
    "test_kv_connector_handles_preemption": _READS_TEST_CONNECTOR_METADATA,
    "test_prefix_cache_stats_counted_once_for_retried_then_scheduled_request": (
        _READS_TEST_CONNECTOR_METADATA
    ),
    "test_has_sync_kv_loads": _PATCHES_CONNECTOR_LOOKUP,
    "test_reset_connector_cache_no_connector_is_no_op_success": (
        "asserts that no connector is configured; the swap always configures LEAP's"
    ),
}
EXPECTED_DIFFERENCES: dict[str, dict[str, str]] = {
    "0.32.0": _COMMON_DIFFERENCES,
    "0.34.0": {
        **_COMMON_DIFFERENCES,
        "test_failed_load_reservation_keeps_new_async_loads_out": _PATCHES_CONNECTOR_LOOKUP,
        "test_cached_reservations_admit_like_on_demand_sum": _PATCHES_CONNECTOR_LOOKUP,
        "test_kv_cache_release_after_keep_pause_preserves_requests": (
            "drives an EngineCore whose executor is a Mock: with any KV connector "
            "configured, wake_up collects the workers' handshake metadata from it "
            "(a Mock, not iterable)"
        ),
    },
}


def _function(node: str) -> str:
    return node.split("::", 1)[1].split("[", 1)[0]


@pytest.mark.parametrize("version", ["0.32.0", "0.34.0"])
def test_vllm_scheduler_suite_passes_with_leap_swapped_in(tmp_path, version):
    swapped = run_suite(version, [SUITE], "leap", tmp_path)
    assert len(swapped) == NUM_TESTS[version], "the suite did not run whole"
    stock_failures, expected = STOCK_FAILURES[version], EXPECTED_DIFFERENCES[version]
    regressions = [
        node
        for node, outcome in swapped.items()
        if outcome != PASSED  # none is skipped stock
        and _function(node) not in stock_failures
        and _function(node) not in expected
    ]
    assert not regressions, f"pass stock, fail with LEAP: {regressions}"
    # the lists stay honest: every expected difference still differs
    passing = {_function(n) for n, outcome in swapped.items() if outcome == PASSED}
    failing = {_function(n) for n, outcome in swapped.items() if outcome == FAILED}
    stale = sorted(name for name in expected if name in passing and name not in failing)
    assert not stale, f"listed as expected differences, yet pass with LEAP: {stale}"
