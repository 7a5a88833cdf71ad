"""Flide at tensor parallel 2 (two CPU workers): packed results equal separate requests.

``PackedClassifier`` reaches the packed pass through ``collective_rpc``,
which runs it on every rank: each rank packs the same token sequence, its
attention stand-in masks its own heads (2 of 4 query heads, 1 of 2 KV heads)
and its Gated-DeltaNet stand-in runs its share of the linear heads; the
model's row-parallel all-reduces join the ranks inside the pass, and rank 0's
answer is returned. The reference is vLLM on the same TP=2 engine, each
``context + question + label`` a separate request (``prompt_logprobs``).
Same models' rules as ``test_flide_engine.py``: dense tiny Llama in fp32
(tolerance 1e-3; SmolLM2's 9 heads do not split over 2 ranks), the tiny
Qwen3-Next hybrid in bf16 (0.05).
"""

from __future__ import annotations

import pytest
from vllm import SamplingParams

from tests.engine.test_flide_engine import CONTEXT, LABELS, QUESTIONS, separate_logprobs
from tests.engine.tp2 import tp2_engine
from vllm_ext.flide.classifier import RPC_METHOD, WORKER_EXTENSION, PackedClassifier

pytestmark = pytest.mark.tp2

TOLERANCE = {"tiny-llama": 1e-3, "tiny-hybrid": 0.05}
OTHER_CONTEXT = "Trains leave the station every hour; the last one leaves at midnight. " * 2
OTHER_QUESTIONS = ["Do trains leave hourly?", "Is there a train at 2 am?"]


@pytest.fixture(scope="module", params=[("tiny-llama", "float32"), ("tiny-hybrid", "bfloat16")],
                ids=["dense-llama-fp32", "hybrid-qwen3next-bf16"])  # fmt: skip
def served(request):
    name, dtype = request.param
    with tp2_engine(name, dtype=dtype, worker_extension_cls=WORKER_EXTENSION,
                    max_model_len=2048) as llm:  # fmt: skip
        yield name, llm


def test_packed_pass_over_two_ranks_equals_separate_requests(served):
    name, llm = served
    clf = PackedClassifier(llm, LABELS)
    # two contexts in one pass: each question sees only its own context
    items = [{"context": CONTEXT, "questions": QUESTIONS},
             {"context": OTHER_CONTEXT, "questions": OTHER_QUESTIONS}]  # fmt: skip
    answers = clf.classify(items)
    asked = [(CONTEXT, q) for q in QUESTIONS] + [(OTHER_CONTEXT, q) for q in OTHER_QUESTIONS]
    assert len(answers) == len(asked)
    tok = clf.tokenizer
    for (context, question), answer in zip(asked, answers, strict=True):
        ref = separate_logprobs(
            llm, tok.encode(context), tok.encode(question, add_special_tokens=False), clf.label_ids
        )
        got = [answer.logprobs[label] for label in LABELS]
        assert got == pytest.approx(ref, abs=TOLERANCE[name]), question
        best = max(range(len(ref)), key=ref.__getitem__)
        if sorted(ref)[-1] - sorted(ref)[-2] > 2 * TOLERANCE[name]:
            assert answer.label == LABELS[best], question


def test_a_payload_every_rank_rejects_leaves_the_engine_serving(served):
    _, llm = served
    # each rank validates before the forward: all refuse, none waits in an all-reduce
    with pytest.raises(Exception, match="outside the vocabulary"):
        llm.collective_rpc(
            RPC_METHOD, args=({"items": [[[1, 2], [[3]]]], "labels": [[1], [10**9]]},)
        )
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
