"""HiState's benchmarks: what each variant records, and the engine benchmark's rounds."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from benchmarks.histate import engine, sim
from vllm_ext.bench import validate_headline
from vllm_ext.histate.traces import agentic_trace, bfcl_trace

pytestmark = pytest.mark.unit


def test_sim_variants_record_the_config_they_simulate() -> None:
    histate = sim.variant_config("histate", 1000.0)
    assert histate["histate"]["time_weight"] == 1000.0
    assert histate["histate"]["release_device_snapshots"] is True
    assert sim.variant_config(sim.KEEP_DEVICE, 1.0)["histate"]["release_device_snapshots"] is False
    assert sim.variant_config("marconi", 4.0)["histate"]["marconi_alpha"] == 4.0
    assert sim.variant_config(sim.ISSUE_SCORE, 1.0)["policy_class"].endswith("IssueScorePolicy")
    floor = sim.variant_config(sim.FLOOR, 1.0)
    assert floor["simulated_policy"] == "histate"
    assert floor["cost_model_changes"] == {"host_bytes": 10**15}
    arc = sim.variant_config("vllm_arc", 1.0)
    # the baseline runs vLLM's own class, not a re-implementation
    assert arc["policy_class"] == "vllm.v1.kv_offload.cpu.policies.arc.ARCCachePolicy"
    assert arc["simulated_policy"] == "lru" and arc["cost_model_changes"] == {}
    assert arc["store_threshold"] == 0
    arc2 = sim.variant_config("vllm_arc_t2", 1.0)
    assert arc2["policy_class"] == arc["policy_class"] and arc2["store_threshold"] == 2


def test_sim_store_threshold_skips_first_offers_only_for_filtered_variants(tmp_path) -> None:
    trace = tmp_path / "t.jsonl"
    sim.save_trace(agentic_trace(seed=0, session_rate=1.0, n_sessions=4, scale=0.02,
                                 block_size=64), trace)  # fmt: skip
    plain, _ = sim._simulate(trace, "vllm_lru", 1.0)
    filtered, _ = sim._simulate(trace, "vllm_lru_t2", 1.0)
    assert plain["stores_skipped"] == 0 and filtered["stores_skipped"] > 0


def test_sim_runs_end_to_end_over_seeds_with_the_floor(tmp_path, monkeypatch) -> None:
    # tiny traces, two seeds, one process: the whole chain from traces to the result file
    tiny = {
        "agentic": (agentic_trace, dict(n_sessions=4, scale=0.02, block_size=64), (0.5, 1.0)),
        "bfcl": (bfcl_trace, dict(n_sessions=3, block_size=64), (2.0,)),
    }
    monkeypatch.setattr(sim, "TRACES", tiny)
    monkeypatch.setattr(sim, "ALPHAS", (0.0, 1.0))
    argv = ["--seeds", "0,1", "--workers", "1", "--trace-dir", str(tmp_path / "t")]
    assert sim.main([*argv, "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "histate_sim.json").read_text())
    h = data["headline"]
    validate_headline(h)
    assert h["rounds"] == 2 and len(h["ours_per_round"]) == 2
    assert h["baseline_name"] in (*sim.BASELINES[:-1], "marconi(alpha=1)", "marconi(alpha=0)")
    bound = data["config"]["no_eviction_floor"]
    assert len(bound["floor_per_seed"]) == 2 and "floor" in bound["target_applied"]
    head = data["config"]["headline_rate"]
    for v in sim.MAIN:
        assert (
            len(
                data["variants"][f"agentic@{head:g}:{v if v != 'marconi' else 'marconi(alpha=1)'}"][
                    "ttft_p99_s_per_seed"
                ]
            )
            == 2
        )


def test_engine_variants_record_engine_arguments_and_resolved_histate_config() -> None:
    native = engine.variant_config("agentic", "native")
    assert native["systems"] == {} and "kv_transfer_config" not in native["engine_kwargs"]
    tight = engine.variant_config("agentic_host24M", "marconi")
    assert tight["systems"]["histate"]["policy"] == "marconi"
    assert tight["systems"]["histate"]["host_bytes"] == 24 * engine.MB
    assert engine.variant_config("agentic", "histate")["systems"]["histate"]["host_bytes"] == (
        64 * engine.MB
    )


def _saved_run(policy: str, p99: float) -> dict:
    # ten turns of one session; TTFT grows so that the p99 is about ``p99``
    records = [
        {"id": f"s0/t{i}", "ttft_s": p99 * (i + 1) / 10, "prompt_tokens": 100,
         "cached_tokens": 50, "output_sha": f"{policy}{i}" if i else "same"}
        for i in range(10)
    ]  # fmt: skip
    return {"records": records, "counters": {}, "wall_s": 1.0, "device_blocks": 42}


def test_engine_rounds_give_a_median_headline_with_the_spread(tmp_path) -> None:
    p99 = {"native": [9.0, 12.0, 10.0], "histate": [4.0, 3.0, 5.0], "lru": [5.0] * 3}
    p99["marconi"] = [8.0] * 3
    for scenario in ("agentic", "agentic_host24M"):
        for policy, values in p99.items():
            if scenario != "agentic" and policy == "native":
                continue  # never served: native ignores the host tier
            for r, value in enumerate(values):
                name = f"run_{scenario}_{policy}{f'_r{r}' if r else ''}.json"
                (tmp_path / name).write_text(json.dumps(_saved_run(policy, value)))
    names = ["agentic", "agentic_host24M"]
    runs = engine.run_all(names, {}, tmp_path, reuse=True, repeats=3)
    # native ignores the host tier: the tight-host scenario reuses agentic's native runs
    assert runs[("agentic_host24M", "native")] == runs[("agentic", "native")]
    assert len(runs[("agentic", "histate")]) == 3
    rounds = engine.per_round_metrics({k: v for k, v in runs.items() if k[0] == "agentic"})
    assert [m["first_turns_equal_native"] for m in rounds["agentic:histate"]] == [1.0] * 3
    result = engine.build_result(
        {k: v for k, v in runs.items() if k[0] == "agentic"},
        {"agentic": 10},
        SimpleNamespace(quick=False, repeats=3, argv=["--repeats", "3"]),
    )
    h = result.headline
    validate_headline(h)
    assert h["rounds"] == 3
    # the baseline is the best of native, LRU and Marconi (here LRU: p99 5 s)
    assert h["baseline_name"] == "lru"
    assert h["ours"] == pytest.approx(sorted(m["ttft_p99_s"] for m in rounds["agentic:histate"])[1])
    assert h["ours_spread"][0] < h["ours"] < h["ours_spread"][1]
    assert result.command == "python -m benchmarks.histate.engine --repeats 3"
    assert set(result.variant_configs) == {f"agentic:{p}" for p in engine.POLICIES}
