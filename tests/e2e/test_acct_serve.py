"""`vllm serve` with the AcctConnector: a long prompt's prefix is imported, the online gate
passes it, and the greedy tokens are plain decoding's (transformers, fp32: the identity import
is exact, so any difference is an import that went wrong); the counters reach `/metrics` in
vLLM naming."""

from __future__ import annotations

import json

import pytest

from tests.e2e.conftest import SERVE_ARGS, metric_value, server_env, wait_for_metric
from vllm_ext.assets import model_path
from vllm_ext.serving import VllmServer

KV_CONFIG = {
    "kv_connector": "AcctConnector",
    "kv_connector_module_path": "vllm_ext.acct.connector",
    "kv_role": "kv_both",
    "kv_load_failure_policy": "recompute",
}
ACCT = {"acct": {"checkpoint": "identity", "min_prefix_tokens": 64, "check_tokens": 16,
                 "check_max_gap": 10.0}}  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "acct.log"
    args = [*SERVE_ARGS, "--served-model-name", "smollm2", "--dtype", "float32",
            "--block-size", "32", "--kv-transfer-config", json.dumps(KV_CONFIG),
            "--additional-config", json.dumps(ACCT)]  # fmt: skip
    with VllmServer(
        str(model_path("smollm2")), args, launcher="vllm", env=server_env(), log_path=log
    ) as srv:
        yield srv


def _chat_ids(prompt: str) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path("smollm2"))
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                        add_generation_prompt=True, tokenize=True)  # fmt: skip
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _plain_greedy(ids: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens of the model without any import (transformers, fp32, no EOS stop)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path("smollm2"), dtype=torch.float32)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)  # fmt: skip
    return out[0, len(ids) :].tolist()


def test_long_prompt_is_imported_passes_the_gate_and_decodes_plain_tokens(server):
    from openai import OpenAI

    from vllm_ext.datasets import first_turns

    prompt = next(s.prompt for s in first_turns(40, seed=3) if 1200 <= len(s.prompt) <= 2400)
    ids = _chat_ids(prompt)
    client = OpenAI(base_url=server.base_url + "/v1", api_key="EMPTY")
    reply = client.completions.create(
        model="smollm2", prompt=ids, max_tokens=8, temperature=0, logprobs=1,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )  # fmt: skip
    served = [int(t.removeprefix("token_id:")) for t in reply.choices[0].logprobs.tokens]
    assert served == _plain_greedy(ids, 8)
    imported = wait_for_metric(server, "vllm_ext:acct_imported_tokens_total", lambda v: v > 0)
    assert imported == (len(ids) - 1) // 32 * 32
    seconds = wait_for_metric(server, "vllm_ext:acct_conversion_seconds_total", lambda v: v > 0)
    assert seconds is not None and seconds > 0
    # the online check ran on the import and passed it: nothing was handed back to vLLM
    text = server.get("/metrics")
    assert "# HELP vllm_ext:acct_gate_failures_total imports the online check rejected" in text
    assert metric_value(text, "vllm_ext:acct_gate_failures_total") == 0
    assert metric_value(text, "vllm_ext:acct_recomputes_total") == 0
