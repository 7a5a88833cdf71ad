"""A user prunes SmolLM2 with one command and serves the sparse checkpoint with `vllm serve`.

``python -m vllm_ext.etaps prune`` runs two tiny ETAPS stages (70 % then 90 %: slots
migrate between them) and exports ``ckpt-90``; plain ``vllm serve`` loads it through
the ``etaps`` quantization method (registered by the suite's plugin). In fp32, the
logprob the server reports for every generated token (decode: the compiled sparse
kernel; the prompt's prefill: the dense fallback, above ``max_sparse_tokens``) equals
the torch forward of the masked dense weights.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.e2e.conftest import REPO, SERVE_ARGS, server_env
from vllm_ext.etaps.export import load_reference
from vllm_ext.kernels.sparse_gemv import compiled_available
from vllm_ext.serving import VllmServer

PROMPT_IDS = [504, 3458, 282, 4649, 314, 2940, 30, 378, 1535, 282, 7042, 314]
MAX_SPARSE_TOKENS = 4  # prompt (12 tokens) dense, decode (1 token) on the kernel


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("etaps")
    cmd = [sys.executable, "-m", "vllm_ext.etaps", "--threads", "2", "prune", "--out", str(out),
           "--final-sparsity", "0.9", "--start-sparsity", "0.7", "--stages", "2",
           "--calib-blocks", "1", "--train-steps", "1", "--block-len", "32"]  # fmt: skip
    subprocess.run(cmd, check=True, cwd=REPO, env={**os.environ, **server_env()})
    summary = json.loads((out / "summary.json").read_text())
    assert [s["sparsity"] for s in summary["log"]] == [0.7, 0.9]
    assert summary["log"][1]["slots_moved"] > 0
    assert 0 < summary["pruner_state_bytes"] < summary["model_bytes"] * 4
    return out / "ckpt-90"


@pytest.fixture(scope="module")
def server(ckpt, tmp_path_factory):
    if not compiled_available():
        pytest.skip("no C++ compiler for the sparse kernel")
    log = tmp_path_factory.mktemp("serve") / "etaps.log"
    config = {"etaps": {"max_sparse_tokens": MAX_SPARSE_TOKENS}}
    args = [*SERVE_ARGS, "--served-model-name", "etaps", "--dtype", "float32",
            "--additional-config", json.dumps(config)]  # fmt: skip
    with VllmServer(str(ckpt), args, launcher="vllm", env=server_env(), log_path=log) as srv:
        yield srv


def test_served_sparse_checkpoint_decodes_like_the_masked_dense_model(server, ckpt):
    from openai import OpenAI

    log = server.log_path.read_text(errors="replace")
    assert "etaps: 90 % sparse checkpoint on cpu; compiled sparse kernel on" in log
    assert f"calls of up to {MAX_SPARSE_TOKENS} tokens" in log
    client = OpenAI(base_url=server.base_url + "/v1", api_key="EMPTY")
    reply = client.completions.create(
        model="etaps", prompt=PROMPT_IDS, max_tokens=6, temperature=0, logprobs=1,
        extra_body={"return_tokens_as_token_ids": True},
    )  # fmt: skip
    lp = reply.choices[0].logprobs
    generated = [int(t.removeprefix("token_id:")) for t in lp.tokens]
    assert len(generated) == reply.usage.completion_tokens == 6
    ids = PROMPT_IDS + generated
    with torch.no_grad():
        logits = load_reference(ckpt)(torch.tensor([ids])).logits[0].float()
    ref = logits.log_softmax(-1)
    start = len(PROMPT_IDS) - 1
    expected = [ref[start + i, tok].item() for i, tok in enumerate(generated)]
    assert max(abs(a - b) for a, b in zip(lp.token_logprobs, expected, strict=True)) < 1e-3
