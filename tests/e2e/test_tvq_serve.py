"""Plain `vllm serve <tvq checkpoint>` + OpenAI client: greedy completions match torch.

The checkpoint is the tiny Llama asset with every MLP linear vector-quantized
(d=2, K=300: int32 codes, fused gate_up_proj), exported in the test. The
server runs in fp32 with the tvq block set through ``--additional-config``
(the kernel for batches up to 64 tokens, so prefill and decode both run it).
Each generated token must be the torch reference model's most likely one
(within 1e-3 nat, for near ties) and the server's logprobs must equal the
reference's on the same tokens.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch

from tests.e2e.conftest import SERVE_ARGS, server_env
from vllm_ext.assets import model_path
from vllm_ext.serving import LAUNCHERS, VllmServer
from vllm_ext.tvq.export import export, load_reference
from vllm_ext.tvq.format import QuantFormat
from vllm_ext.tvq.qat import quantize_mlps

PROMPTS = [[5, 17, 99, 3, 42, 8, 61, 77], [1200, 9, 30, 2, 55]]
FMT = QuantFormat(2, 300)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    base = model_path("tiny-llama")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    quantize_mlps(model, FMT.vec_dim, FMT.num_codewords, kmeans_iters=3)
    return export(model, base, tmp_path_factory.mktemp("tvq") / "ckpt", FMT)


@pytest.fixture(scope="module")
def server(ckpt, tmp_path_factory):
    extra = json.dumps({"tvq": {"max_kernel_tokens": 64}})
    args = [*SERVE_ARGS, "--dtype", "float32", "--served-model-name", "tvq"]
    with VllmServer(
        str(ckpt),
        [*args, "--additional-config", extra],
        launcher="vllm",
        env=server_env(),
        log_path=tmp_path_factory.mktemp("serve") / "tvq.log",
    ) as srv:
        yield srv


def test_greedy_completions_equal_the_torch_reference(server, ckpt):
    from openai import OpenAI

    client = OpenAI(base_url=server.base_url + "/v1", api_key="EMPTY")
    reference = load_reference(ckpt)
    for prompt in PROMPTS:
        reply = client.completions.create(
            model="tvq", prompt=prompt, max_tokens=6, temperature=0, logprobs=1,
            extra_body={"return_tokens_as_token_ids": True},
        )  # fmt: skip
        lp = reply.choices[0].logprobs
        tokens = [int(t.removeprefix("token_id:")) for t in lp.tokens]
        assert len(tokens) == 6
        with torch.no_grad():
            ids = torch.tensor([prompt + tokens])
            logp = reference(ids).logits[0].float().log_softmax(-1)
        for i, (tok, served) in enumerate(zip(tokens, lp.token_logprobs, strict=True)):
            row = logp[len(prompt) - 1 + i]
            assert row[tok] >= row.max() - 1e-3, (prompt, i, tok, int(row.argmax()))
            assert abs(served - row[tok].item()) < 1e-3


def test_vllm_ext_serve_refuses_a_bad_tvq_block_before_vllm_starts(ckpt):
    bad = json.dumps({"tvq": {"max_kernel_tokens": -1}})
    cmd = [*LAUNCHERS["vllm-ext"], "serve", str(ckpt), "--additional-config", bad]
    env = {**os.environ, **server_env()}
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "max_kernel_tokens" in result.stderr and "Traceback" not in result.stderr
    assert "non-default args" not in result.stderr
