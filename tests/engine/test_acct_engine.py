"""AcctConnector inside a real vLLM engine (SmolLM2-135M, fp32, CPU).

Plumbing exactness: with the identity import (the target's own KV, computed by
ACCT's torch runner and written through the CPU backend's cache-write op) the
engine decodes exactly the greedy tokens of plain vLLM; the counters prove the
prefix was imported, not prefilled. Fallback, behind MultiConnector: a
checkpoint whose converters were corrupted after their gate was measured fails
the online check, vLLM recomputes the prefix itself, and the output is again
plain vLLM's. Every case ends with no per-request state left.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.helpers import engine
from vllm_ext.acct import checkpoint as ckpt
from vllm_ext.acct.converter import Converters
from vllm_ext.acct.llama import LlamaShape
from vllm_ext.assets import model_path

MODEL = "smollm2"
BLOCK = 32
ENGINE = dict(dtype="float32", block_size=BLOCK, max_model_len=2048, enable_prefix_caching=False)
CONNECTOR = {"kv_connector": "AcctConnector", "kv_connector_module_path": "vllm_ext.acct.connector",
             "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}  # fmt: skip


def _prompts() -> list[list[int]]:
    from transformers import AutoTokenizer

    from vllm_ext.datasets import first_turns

    tok = AutoTokenizer.from_pretrained(model_path(MODEL))
    prompts = []
    for sample in first_turns(40, seed=3):
        ids = tok.apply_chat_template(
            [{"role": "user", "content": sample.prompt}], add_generation_prompt=True
        )
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        if 200 <= len(ids) <= 600:
            prompts.append(ids)
    # one prompt one token past a block boundary, one ending on it
    return [prompts[0], prompts[1][: 5 * BLOCK + 1], prompts[2][: 6 * BLOCK]]


PROMPTS = _prompts()


def _greedy(llm) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _acct(checkpoint: str, multi: bool = False, **acct) -> dict:
    kv = dict(CONNECTOR)
    if multi:
        counting = {"kv_connector": "CountingConnector", "kv_role": "kv_both",
                    "kv_connector_module_path": "tests.e2e.counting_connector"}  # fmt: skip
        kv = {"kv_connector": "MultiConnector", "kv_role": "kv_both",
              "kv_load_failure_policy": "recompute",
              "kv_connector_extra_config": {"connectors": [counting, CONNECTOR]}}  # fmt: skip
    block = {"checkpoint": checkpoint, "min_prefix_tokens": 64, **acct}
    return {**ENGINE, "kv_transfer_config": kv, "additional_config": {"acct": block}}


def _connectors(llm):
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    scheduler = llm.llm_engine.engine_core.engine_core.scheduler.connector
    worker = get_kv_transfer_group()
    if type(worker).__name__ == "MultiConnector":
        scheduler, worker = scheduler._connectors[1], worker._connectors[1]
    return scheduler, worker


@pytest.fixture(scope="module")
def reference():
    with engine(MODEL, **ENGINE) as llm:
        out = _greedy(llm)
    del llm
    return out


def _expected_import(prompt) -> int:
    return (len(prompt) - 1) // BLOCK * BLOCK


def test_identity_import_decodes_like_plain_vllm(reference):
    with engine(MODEL, **_acct("identity", check_tokens=0)) as llm:
        out = _greedy(llm)
        scheduler, worker = _connectors(llm)
        imported = worker.counters.value("imported_tokens")
        assert worker.counters.value("recomputes") == 0
        assert worker.counters.value("conversion_seconds") > 0
        assert all(v == 0 for v in scheduler.idle_state().values())
    del llm
    assert imported == sum(_expected_import(p) for p in PROMPTS)
    assert out == reference


@pytest.fixture(scope="module")
def corrupted_checkpoint(tmp_path_factory):
    """Converters with random weights and a (stale) passing gate report."""
    folder = model_path(MODEL)
    shape = LlamaShape.from_config(json.loads((folder / "config.json").read_text()))
    converters = Converters(shape, 4)
    torch.manual_seed(0)
    for linear in converters.proj:
        torch.nn.init.normal_(linear.weight, std=1.0)
    out = tmp_path_factory.mktemp("acct") / "corrupted"
    meta = ckpt.CheckpointMeta(ckpt.target_identity(folder), 4, 4)
    meta.gate = {"delta_nll": 0.0, "top1": 1.0, "windows": 8}
    ckpt.save(out, converters, meta)
    return str(out)


def test_online_check_failure_recomputes_to_plain_output(reference, corrupted_checkpoint):
    # behind MultiConnector (before it, a connector that offers nothing): composition too
    with engine(MODEL, **_acct(corrupted_checkpoint, multi=True, check_tokens=16)) as llm:
        out = _greedy(llm)
        scheduler, worker = _connectors(llm)
        failures = worker.counters.value("gate_failures")
        recomputes = worker.counters.value("recomputes")
        imported = worker.counters.value("imported_tokens")
        assert all(v == 0 for v in scheduler.idle_state().values())
    del llm
    assert failures == recomputes == len(PROMPTS) and imported == 0
    assert out == reference


def test_checkpoint_failing_its_offline_gate_is_a_startup_error(corrupted_checkpoint, tmp_path):
    failing = shutil.copytree(corrupted_checkpoint, tmp_path / "failing")
    ckpt.write_gate(failing, {"delta_nll": 1.7, "top1": 0.57, "windows": 8})
    with pytest.raises(Exception, match="fails the offline gate: delta NLL 1.7"):
        with engine(MODEL, **_acct(str(failing))):
            pass
