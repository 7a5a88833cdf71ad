"""LEAP at tensor parallel 2 (two CPU workers): the same probes, predictions and order as TP=1.

The probe hooks decoder layer L's output. Under tensor parallelism each
rank's layer ends in a row-parallel projection whose all-reduce makes that
output whole (the full hidden state) on every rank, so each rank captures
the same vectors; vLLM merges the ranks' worker metadata
(``LeapWorkerMetadata.aggregate`` keeps one vector per request) before the
scheduler sees it. One queueing run (probe lane, preemption by predicted
length) on tiny Llama (4 heads, 2 KV heads: 2 + 1 per rank) is traced at
TP=1 and TP=2: the schedules must be identical, the predictions equal, and
every TP=2 probe equal to transformers' fp32 hidden state of the prompt.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.engine.leap_helpers import (
    hf_hidden_state,
    leap_connector_of,
    leap_engine_kwargs,
    record_schedule,
    write_weights,
)
from tests.engine.tp2 import tp2_engine
from tests.helpers import engine

pytestmark = pytest.mark.tp2

MODEL = "tiny-llama"
LAYER = 0
PROMPTS = [list(range(100 + 7 * i, 100 + 7 * i + n)) for i, n in enumerate((40, 300, 90, 13))]
REQUESTS = [(f"q{i}", PROMPTS[i % 4][: 30 + 11 * i], 24) for i in range(8)]


def _leap(weights) -> dict:
    # the probe lane reads waiting requests' probes early; preemption acts on the predictions;
    # no wall-clock rule may act (aging, prediction timeout): TP=2 steps take longer than TP=1's
    return {"weights_path": str(weights), "layer": LAYER, "probe_slots": 1, "preempt_margin": 0.0,
            "max_preemptions": 8, "return_probe": True, "max_wait_s": 3600.0,
            "prediction_timeout_s": 3600.0}  # fmt: skip


def _queueing_run(llm) -> dict:
    """Schedule trace, predictions, probes and outputs of :data:`REQUESTS` on ``llm``."""
    from vllm import SamplingParams

    trace = record_schedule(llm)
    for rid, prompt, n in REQUESTS:
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        llm.llm_engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    predicted, probes, outputs = {}, {}, {}
    while llm.llm_engine.has_unfinished_requests():
        for out in llm.llm_engine.step():
            if out.finished:
                info = out.kv_transfer_params["leap"]
                predicted[out.request_id] = info["predicted_tokens"]
                probes[out.request_id] = np.asarray(info["probe"])
                outputs[out.request_id] = list(out.outputs[0].token_ids)
    counters = leap_connector_of(llm).counters
    return {"trace": trace, "predicted": predicted, "probes": probes, "outputs": outputs,
            "lane_probes": counters.value("lane_probes"),
            "preemptions": counters.value("preemptions")}  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    weights = write_weights(tmp_path_factory.mktemp("leap-tp2") / "w.npz", 128)
    kwargs = leap_engine_kwargs(_leap(weights), dtype="float32", max_num_seqs=3)
    with engine(MODEL, **kwargs) as llm:
        tp1 = _queueing_run(llm)
    del llm
    with tp2_engine(MODEL, **kwargs) as llm:
        tp2 = _queueing_run(llm)
    del llm
    return tp1, tp2


def test_probes_are_the_whole_hidden_state_on_two_ranks(runs):
    _, tp2 = runs
    assert set(tp2["probes"]) == {rid for rid, _, _ in REQUESTS}
    for rid, prompt, _ in REQUESTS:
        truth = hf_hidden_state(MODEL, prompt, LAYER)
        np.testing.assert_allclose(tp2["probes"][rid], truth, rtol=1e-4, atol=1e-4, err_msg=rid)


def test_predictions_and_schedule_equal_tensor_parallel_1(runs):
    tp1, tp2 = runs
    # the run exercises what the predictions decide: the lane and preemption
    assert tp1["lane_probes"] >= 1 and tp1["preemptions"] >= 1
    assert tp2["predicted"] == pytest.approx(tp1["predicted"], rel=1e-6)
    assert tp2["trace"] == tp1["trace"]
    assert (tp2["lane_probes"], tp2["preemptions"]) == (tp1["lane_probes"], tp1["preemptions"])
    assert tp2["outputs"] == tp1["outputs"]
