"""LEAP inside a real vLLM engine (tiny Llama, CPU, in-process).

Covers the probe (equal to transformers' hidden state, across chunked prefill
and prefix-cache hits), FCFS equivalence without information, shortest-first
ordering and SRPT preemption by predicted length, failure fallback, RLS
checkpoints, leak-freedom after aborts, and composition with another
connector through MultiConnector.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.engine.leap_helpers import (
    hf_hidden_state,
    leap_connector_of,
    leap_engine_kwargs,
    record_schedule,
    run_to_completion,
    scheduler_of,
    write_weights,
)
from tests.helpers import engine
from vllm_ext.leap.runtime import HINT_KEY

MODEL = "tiny-llama"
REPO = Path(__file__).resolve().parents[2]
PROMPTS = [list(range(100 + 7 * i, 100 + 7 * i + n)) for i, n in enumerate((40, 700, 90, 13))]


def _params(max_tokens=8, hint=None, ignore_eos=True):
    from vllm import SamplingParams

    extra = {HINT_KEY: hint} if hint is not None else None
    return SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos, extra_args=extra
    )


# next_step: the vectors reach the scheduler a step late, as on CUDA by default
@pytest.mark.parametrize("delivery", ["same_step", "next_step"])
def test_probe_equals_transformers_hidden_state_with_chunks_and_cache_hits(delivery):
    leap = {"layer": 0, "return_probe": True, "probe_delivery": delivery}
    with engine(
        MODEL, **leap_engine_kwargs(leap, dtype="float32", max_num_batched_tokens=256)
    ) as llm:
        first = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], _params())
        again = llm.generate([{"prompt_token_ids": PROMPTS[1]}], _params())[0]
        # a request that ends in its prefill step finishes before a late vector comes
        one = llm.generate([{"prompt_token_ids": PROMPTS[2]}], _params(max_tokens=1))[0]
    assert (one.kv_transfer_params["leap"]["probe"] is None) == (delivery == "next_step")
    assert again.num_cached_tokens > 0  # second run hit the prefix cache
    for prompt, out in zip(PROMPTS, first, strict=True):
        probe = np.asarray(out.kv_transfer_params["leap"]["probe"])
        np.testing.assert_allclose(probe, hf_hidden_state(MODEL, prompt, 0), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(
        again.kv_transfer_params["leap"]["probe"],
        first[1].kv_transfer_params["leap"]["probe"],
        rtol=1e-5,
        atol=1e-5,
    )


def _traced_run(llm, requests):
    trace = record_schedule(llm)
    for rid, prompt, params in requests:
        llm.llm_engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    return trace, run_to_completion(llm)


def _queueing_requests():
    lengths = (30, 5, 18, 9, 25, 3, 12, 7)
    return [(f"r{i}", PROMPTS[i % 4][: 20 + 9 * i], _params(n)) for i, n in enumerate(lengths)]


@pytest.mark.parametrize("predictor", ["none", "constant"])
def test_without_information_the_schedule_is_exactly_vllms(tmp_path, predictor):
    # small batch and KV pool so requests queue and vLLM itself preempts
    common = dict(max_num_seqs=2, num_gpu_blocks_override=7, block_size=32, max_model_len=192)
    with engine(MODEL, **common) as llm:
        stock_trace, stock_out = _traced_run(llm, _queueing_requests())
    del llm
    # constant: every request predicted at 10 tokens, never corrected
    leap = (
        {}
        if predictor == "none"
        else {
            "weights_path": str(write_weights(tmp_path / "w.npz", 128, constant=10.0)),
            "online_rls": False,
            "probe_slots": 1,  # the lane, too, stands down without information
        }
    )
    with engine(MODEL, **leap_engine_kwargs(leap, **common)) as llm:
        leap_trace, leap_out = _traced_run(llm, _queueing_requests())
    assert leap_trace == stock_trace
    assert leap_out == stock_out


def test_hints_serve_shortest_predicted_first():
    with engine(MODEL, **leap_engine_kwargs({}, max_num_seqs=1)) as llm:
        trace = record_schedule(llm)
        for rid, n in (("a", 24), ("b", 4), ("c", 12), ("d", 8)):
            llm.llm_engine.add_request(rid, {"prompt_token_ids": PROMPTS[0]}, _params(n, hint=n))
        run_to_completion(llm)
    started = []
    for step in trace:
        for rid, _ in step:
            if rid not in started:
                started.append(rid)
    assert started == ["b", "d", "c", "a"]


def _start_order(trace) -> list[str]:
    started: list[str] = []
    for step in trace:
        started += [rid for rid, _ in step if rid not in started]
    return started


@pytest.mark.parametrize("model", ["informative", "constant"])
def test_prompt_length_prior_acts_only_beside_an_informative_model(tmp_path, model):
    constant = 10.0 if model == "constant" else None
    weights = write_weights(tmp_path / "w.npz", 128, constant=constant)
    leap = {"weights_path": str(weights), "online_rls": False, "preempt": False}
    with engine(MODEL, **leap_engine_kwargs(leap, max_num_seqs=1)) as llm:
        trace = record_schedule(llm)
        for rid, n in (("p300", 300), ("p20", 20), ("p90", 90)):
            llm.llm_engine.add_request(rid, {"prompt_token_ids": PROMPTS[1][:n]}, _params(4))
        run_to_completion(llm)
    # the default prior, prompt_length: shortest prompt first; a constant model: vLLM's FCFS
    expected = ["p300", "p20", "p90"] if model == "constant" else ["p20", "p90", "p300"]
    assert _start_order(trace) == expected


def test_shorter_arrival_preempts_longest_and_outputs_are_unchanged():
    with engine(MODEL, **leap_engine_kwargs({"preempt_margin": 0.5}, max_num_seqs=1)) as llm:
        solo = llm.generate([{"prompt_token_ids": PROMPTS[2]}], _params(40))[0].outputs[0]
        engine_ = llm.llm_engine
        engine_.add_request("long", {"prompt_token_ids": PROMPTS[2]}, _params(40, hint=40))
        finished = []
        for _ in range(6):
            finished += [o.request_id for o in engine_.step() if o.finished]
        engine_.add_request("short", {"prompt_token_ids": PROMPTS[3]}, _params(3, hint=3))
        outputs = run_to_completion(llm)  # finished outputs, in finishing order
        finished += list(outputs)
        counters = leap_connector_of(llm).counters
    assert finished == ["short", "long"]
    assert counters.value("preemptions") == 1
    assert outputs["long"] == list(solo.token_ids)


@pytest.mark.parametrize("remaining, finished_first", [("point", "long"), ("conditional", "short")])
def test_a_runner_past_its_prediction_is_parked_only_under_the_conditional_remaining(
    tmp_path, remaining, finished_first
):
    weights = write_weights(tmp_path / "w.npz", 128)  # predicts about 120 tokens here
    # loops off: tiny-llama's answer repeats one token, which would say it runs to its cap
    leap = {"weights_path": str(weights), "remaining": remaining, "error_log_std": 1.0}
    leap["loops"] = "off"
    with engine(MODEL, **leap_engine_kwargs(leap, max_num_seqs=1)) as llm:
        solo = llm.generate([{"prompt_token_ids": PROMPTS[2]}], _params(240))[0].outputs[0]
        engine_ = llm.llm_engine
        engine_.add_request("long", {"prompt_token_ids": PROMPTS[2]}, _params(240))
        engine_.step()
        (runner,) = scheduler_of(llm).running  # vLLM's own id for "long"
        predicted = leap_connector_of(llm).runtime.prediction(runner.request_id).total_tokens
        assert predicted < 200
        # past its prediction: the point rule says 1 token left, shorter than the arrival's 3
        while runner.num_output_tokens < predicted + 10:
            engine_.step()
        engine_.add_request("short", {"prompt_token_ids": PROMPTS[3]}, _params(3, hint=3))
        outputs = run_to_completion(llm)  # finished outputs, in finishing order
        finished = list(outputs)
    assert finished[0] == finished_first
    assert outputs["long"] == list(solo.token_ids)


@pytest.mark.parametrize("max_tokens, finished_first", [(3, "short"), (100, "long")])
def test_an_unprobed_arrival_counts_as_at_most_its_max_tokens(tmp_path, max_tokens, finished_first):
    weights = write_weights(tmp_path / "w.npz", 128)
    with engine(MODEL, **leap_engine_kwargs({"weights_path": str(weights)}, max_num_seqs=1)) as llm:
        typical = leap_connector_of(llm).runtime.typical_tokens
        assert 60 < typical < 100  # the prior: longer than the runner's 54 left, below 100
        solo = llm.generate([{"prompt_token_ids": PROMPTS[2]}], _params(60))[0].outputs[0]
        engine_ = llm.llm_engine
        engine_.add_request("long", {"prompt_token_ids": PROMPTS[2]}, _params(60, hint=60))
        for _ in range(6):
            engine_.step()
        # no hint, not prefilled yet: the prior, capped at what it may write
        engine_.add_request("short", {"prompt_token_ids": PROMPTS[3]}, _params(max_tokens))
        outputs = run_to_completion(llm)  # finished outputs, in finishing order
        finished = list(outputs)
        parks = leap_connector_of(llm).counters.value("preemptions")
    assert finished[0] == finished_first
    assert parks == (1 if finished_first == "short" else 0)
    assert outputs["long"] == list(solo.token_ids)


@pytest.mark.parametrize("loops, finished_first", [("greedy", "short"), ("off", "long")])
def test_a_runner_caught_in_a_loop_counts_as_running_to_its_cap(tmp_path, loops, finished_first):
    # tiny-llama's greedy answer to this prompt repeats one token from the start
    weights = write_weights(tmp_path / "w.npz", 128)
    leap = {"weights_path": str(weights), "loops": loops}
    with engine(MODEL, **leap_engine_kwargs(leap, max_num_seqs=1)) as llm:
        solo = llm.generate([{"prompt_token_ids": PROMPTS[2]}], _params(300))[0].outputs[0]
        engine_ = llm.llm_engine
        engine_.add_request("long", {"prompt_token_ids": PROMPTS[2]}, _params(300))
        engine_.step()
        (runner,) = scheduler_of(llm).running
        runtime = leap_connector_of(llm).runtime
        while runner.num_output_tokens < 48:  # checked every 8 tokens past the 32-token span
            engine_.step()
        predicted = runtime.prediction(runner.request_id).total_tokens
        # the arrival's 150 tokens: more than the runner's prediction has left (about
        # 170 - 48), fewer than its cap has (300 - 48)
        assert predicted == 300 if loops == "greedy" else 48 + 100 < predicted < 48 + 150
        engine_.add_request("short", {"prompt_token_ids": PROMPTS[3]}, _params(150, hint=150))
        outputs = run_to_completion(llm)  # finished outputs, in finishing order
        finished = list(outputs)
        counters = leap_connector_of(llm).counters
    assert finished[0] == finished_first
    assert counters.value("loops") == (2 if loops == "greedy" else 0)  # the solo run's too
    assert counters.value("preemptions") == (1 if loops == "greedy" else 0)
    assert outputs["long"] == list(solo.token_ids)


def test_a_loop_is_caught_when_speculative_steps_jump_over_the_check_multiples():
    # ngram drafts of 7 tokens on a repeating answer: once drafts are accepted each
    # step writes 8 tokens from an odd count (34, 42, 50, ...), never a multiple of 8.
    # Its own process: vLLM 0.32 fails to start any later engine in a process where
    # the ngram proposer has imported numba (its kernel scan trips on llvmlite)
    run = subprocess.run(
        [sys.executable, "-m", "tests.engine.leap_speculative_run"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
        env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
    )
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    counts = result["counts"]
    assert result["predicted"] == 300
    assert not result["still_due"]  # its check entry is dropped the step after it finishes
    assert any(b - a > 1 for a, b in zip(counts, counts[1:], strict=False))  # drafts accepted
    # found by the check at the start of the last step: the first one due, at the
    # first count past the multiple of 8 after the 32-token span
    assert counts[-3] < 40 <= counts[-2]


def test_probe_lane_probes_the_queue_early_and_outputs_are_unchanged(tmp_path):
    requests = [(f"q{i}", PROMPTS[i % 4][: 30 + 11 * i], _params(24)) for i in range(8)]
    with engine(MODEL, **leap_engine_kwargs({}, max_num_seqs=3)) as llm:
        _, stock = _traced_run(llm, requests)
    del llm
    # this random head predicts 76..95 tokens (above max_tokens); no margin
    weights = write_weights(tmp_path / "w.npz", 128)
    leap = {"weights_path": str(weights), "probe_slots": 1, "preempt_margin": 0.0}
    leap["max_preemptions"] = 8
    with engine(MODEL, **leap_engine_kwargs(leap, max_num_seqs=3)) as llm:
        runtime = leap_connector_of(llm).runtime
        predicted = {}
        trace = record_schedule(llm)
        for rid, prompt, params in requests:
            llm.llm_engine.add_request(rid, {"prompt_token_ids": prompt}, params)
        finished, outputs = [], {}
        while llm.llm_engine.has_unfinished_requests():
            for out in llm.llm_engine.step():
                if out.finished:
                    finished.append(out.request_id)
                    outputs[out.request_id] = list(out.outputs[0].token_ids)
                    predicted[out.request_id] = out.kv_transfer_params["leap"]["predicted_tokens"]
        counters = leap_connector_of(llm).counters
        pool = scheduler_of(llm).kv_cache_manager.block_pool
        assert runtime.num_live() == 0
        assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1  # minus the null block
    assert outputs == stock  # parking and resuming keep greedy outputs exact
    # one probe per step: every request is prefilled (probed) before the first one ends
    first_end = next(i for i, step in enumerate(trace) if len(step) < 3 and i > 8)
    assert set(_start_order(trace[:first_end])) == {rid for rid, _, _ in requests}
    assert counters.value("lane_probes") >= 1
    assert counters.value("preemptions") >= 1
    # every prediction is above max_tokens, which caps the remaining: all count alike
    assert min(predicted.values()) > 24


def test_corrupt_weights_file_is_a_named_startup_error(tmp_path):
    weights = write_weights(tmp_path / "nan.npz", 128, nan=True)
    with pytest.raises(Exception, match="nan.npz"):
        with engine(MODEL, **leap_engine_kwargs({"weights_path": str(weights)})):
            pass


def test_missing_probe_times_out_to_fcfs_and_serves_everything(tmp_path):
    # weights but no probe (plain load format): no vector ever arrives
    weights = write_weights(tmp_path / "w.npz", 128)
    leap = {"weights_path": str(weights), "prediction_timeout_s": 0.001}
    with engine(MODEL, **leap_engine_kwargs(leap, load_format="auto")) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], _params(24))
        counters = leap_connector_of(llm).counters
    assert all(len(o.outputs[0].token_ids) == 24 for o in outs)
    assert counters.value("fallbacks") == len(PROMPTS)
    assert counters.value("predictions") == 0


def test_absurd_predictions_are_clamped_and_never_corrupt_the_model(tmp_path):
    weights = write_weights(tmp_path / "huge.npz", 128, overflow=True)
    with engine(MODEL, **leap_engine_kwargs({"weights_path": str(weights)})) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], _params(6))
        connector = leap_connector_of(llm)
    predicted = [o.kv_transfer_params["leap"]["predicted_tokens"] for o in outs]
    assert all(1 <= p <= 8192 for p in predicted)
    assert all(len(o.outputs[0].token_ids) == 6 for o in outs)
    assert connector.counters.value("rls_updates") == 0
    connector.runtime.model.check_invariants()


@pytest.mark.parametrize("rls_thread", [False, True], ids=["inline", "background"])
def test_rls_corrects_online_and_checkpoints(tmp_path, rls_thread):
    # predicts 2 tokens; every request runs to its 10-token cap, so RLS learns
    weights = write_weights(tmp_path / "w.npz", 128, constant=2.0)
    ckpt = tmp_path / "ckpt.npz"
    leap = {"weights_path": str(weights), "checkpoint_path": str(ckpt), "checkpoint_every": 2,
            "rls_thread": rls_thread}  # fmt: skip
    with engine(MODEL, **leap_engine_kwargs(leap)) as llm:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS], _params(10, ignore_eos=False)
        )
        counters = leap_connector_of(llm).counters
        runtime = leap_connector_of(llm).runtime
        runtime.drain()
    assert runtime.background_rls == rls_thread
    assert counters.value("predictions") == len(PROMPTS)
    assert counters.value("rls_updates") == len(PROMPTS)
    assert counters.value("checkpoints") >= 1 and ckpt.exists()
    from vllm_ext.leap.predictor import LinearLengthModel

    assert LinearLengthModel.load(ckpt).n_updates == runtime.model.n_updates - (
        runtime.model.n_updates % 2
    )
    assert all(o.kv_transfer_params["leap"]["predicted_tokens"] > 0 for o in outs)


def test_a_request_ending_at_its_first_token_is_predicted_and_learned_from(tmp_path):
    # vLLM finishes such a request before it passes the step's connector output on
    from vllm import SamplingParams

    weights = write_weights(tmp_path / "w.npz", 128)
    prompt = {"prompt_token_ids": PROMPTS[0]}
    with engine(MODEL, **leap_engine_kwargs({"weights_path": str(weights)})) as llm:
        first = llm.generate([prompt], _params(1))[0]
        token = first.outputs[0].token_ids[0]
        stop_at_first = SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[token])
        stopped = llm.generate([prompt], stop_at_first)[0]
        connector = leap_connector_of(llm)
        assert connector.runtime.num_live() == 0
    assert first.kv_transfer_params["leap"]["predicted_tokens"] is not None
    assert stopped.outputs[0].finish_reason == "stop" and len(stopped.outputs[0].token_ids) == 1
    assert stopped.kv_transfer_params["leap"]["predicted_tokens"] is not None
    assert connector.counters.value("predictions") == 2
    assert connector.counters.value("rls_updates") == 1  # the capped one is known only as >= 1


def test_aborts_in_every_state_leak_nothing(tmp_path):
    weights = write_weights(tmp_path / "w.npz", 128)
    kwargs = leap_engine_kwargs({"weights_path": str(weights)}, max_num_seqs=2)
    with engine(MODEL, **kwargs) as llm:
        engine_ = llm.llm_engine
        for i in range(6):
            engine_.add_request(f"q{i}", {"prompt_token_ids": PROMPTS[i % 4]}, _params(20))
        engine_.abort_request(["q5"])  # waiting, never scheduled
        engine_.step()
        engine_.step()
        engine_.abort_request(["q0", "q4"])  # running and waiting
        run_to_completion(llm)
        scheduler = scheduler_of(llm)
        runtime = leap_connector_of(llm).runtime
        pool = scheduler.kv_cache_manager.block_pool
        assert not scheduler.requests and not scheduler.running and not scheduler.waiting
        assert runtime.num_live() == 0
        assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1  # minus the null block


def test_leap_composes_with_another_connector_through_multiconnector(tmp_path):
    weights = write_weights(tmp_path / "w.npz", 128)
    kwargs = leap_engine_kwargs({"weights_path": str(weights)})
    leap_kv = kwargs["kv_transfer_config"]
    other = {
        "kv_connector": "CountingConnector",
        "kv_role": "kv_both",
        "kv_connector_module_path": "tests.e2e.counting_connector",
    }
    kwargs["kv_transfer_config"] = {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"connectors": [other, leap_kv]},
    }
    with engine(MODEL, **kwargs) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], _params(5))
        # ends in its prefill step: its probe must be found inside MultiConnector's metadata
        one = llm.generate([{"prompt_token_ids": PROMPTS[0]}], _params(1))[0]
        counters = leap_connector_of(llm).counters
    assert counters.value("predictions") == len(PROMPTS) + 1
    assert all(o.kv_transfer_params is not None for o in outs)
    assert one.kv_transfer_params["leap"]["predicted_tokens"] is not None
