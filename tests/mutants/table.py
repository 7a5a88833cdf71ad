"""``make mutants``: per system, its core decision, the twin that disables it, and the
tests that must then fail (kept to a few files, so the whole run takes minutes).

``patches``: ``(module, qualname, twin factory)``; a module that imported the
decision by name is patched too. ``tests``: pytest node ids or files.
"""

from __future__ import annotations

from dataclasses import dataclass

from tests.mutants import twins


@dataclass(frozen=True)
class Mutant:
    name: str
    system: str
    decision: str
    disabled: str
    patches: tuple[tuple[str, str, object], ...]
    tests: tuple[str, ...]


MUTANTS = (
    Mutant(
        "leap-fcfs", "LEAP", "order by predicted remaining length", "FCFS (arrival order)",
        (("vllm_ext.leap.policy", "LeapPolicy.unaged_key", twins.leap_unaged_key_fcfs),
         ("vllm_ext.leap.running_order", "order", twins.leap_running_order_fcfs)),
        ("tests/unit/test_leap_policy.py", "tests/unit/test_leap_running_order.py",
         "tests/engine/test_leap_engine.py::test_hints_serve_shortest_predicted_first"),
    ),
    Mutant(
        "histate-lru", "HiState", "eviction score (clock + loss per MiB)", "LRU",
        (("vllm_ext.histate.policy", "HiStatePolicy.score", twins.histate_score_lru),),
        ("tests/unit/test_histate_queue.py", "tests/unit/test_histate_cache_policy.py"),
    ),
    Mutant(
        "histate-cold", "HiState", "restore a prefix from its tiers", "cold (every lookup misses)",
        (("vllm_ext.histate.runtime", "HiStateRuntime.plan_load", twins.histate_plan_load_cold),),
        ("tests/unit/test_histate_runtime.py",
         "tests/engine/test_histate_engine.py::test_restored_prefix_decodes_the_cold_tokens"),
    ),
    Mutant(
        "flide-mask", "Flide", "a question sees only its context and itself",
        "plain causal mask over the packed sequence",
        (("vllm_ext.flide.packing", "_ancestry", twins.flide_ancestry_causal),),
        ("tests/unit/test_flide_packing.py",),
    ),
    Mutant(
        "flide-state", "Flide", "a question's recurrent state restarts from its context's end",
        "every segment starts from zero state",
        (("vllm_ext.flide.recurrent", "segmented_delta_rule", twins.flide_delta_rule_zero_start),
         ("vllm_ext.flide.forward", "segmented_delta_rule", twins.flide_delta_rule_zero_start)),
        ("tests/unit/test_flide_packing.py",),
    ),
    Mutant(
        "ark-random", "ARK", "source ports planned from the announced transfers",
        "a random candidate port",
        (("vllm_ext.ark.planner", "choose", twins.ark_choose_random),
         ("vllm_ext.ark.selector", "choose", twins.ark_choose_random),
         ("vllm_ext.ark.connplan", "choose", twins.ark_choose_random)),
        ("tests/unit/test_ark_planner.py", "tests/e2e/test_ark_pd_serve.py"),
    ),
    Mutant(
        "acct-always", "ACCT", "online gate rejects a bad import", "always import",
        (("vllm_ext.acct.importer", "ImportStep._passes", twins.acct_gate_always),),
        ("tests/engine/test_acct_engine.py::test_online_check_failure_recomputes_to_plain_output",),
    ),
    Mutant(
        "acct-never", "ACCT", "online gate accepts a good import", "never import",
        (("vllm_ext.acct.importer", "ImportStep._passes", twins.acct_gate_never),),
        ("tests/e2e/test_acct_serve.py",),
    ),
    Mutant(
        "tvq-relookup", "TVQ", "codes re-looked-up after latent updates",
        "codes frozen after the first lookup",
        (("vllm_ext.tvq.qat", "VQLinear.relookup", twins.tvq_relookup_once),),
        ("tests/unit/test_tvq_algorithms.py",),
    ),
    Mutant(
        "etaps-migrate", "ETAPS", "a pruned slot moves to the largest-gradient survivor",
        "slots stay on pruned weights",
        (("vllm_ext.etaps.slots", "migrate_slots", twins.etaps_migrate_none),
         ("vllm_ext.etaps.pruner", "migrate_slots", twins.etaps_migrate_none)),
        ("tests/unit/test_etaps_algorithms.py", "tests/unit/test_etaps_pruner.py"),
    ),
)  # fmt: skip


def by_name(name: str) -> Mutant:
    for mutant in MUTANTS:
        if mutant.name == name:
            return mutant
    raise KeyError(f"unknown mutant {name!r}; known: {', '.join(m.name for m in MUTANTS)}")
