"""The converted SmolLM2 folder serves the same greedy tokens in vLLM as in transformers.

Both run fp32 on CPU, so any difference is a conversion or loading bug (wrong
rope_theta, tokenizer, tied embeddings), not rounding.
"""

from __future__ import annotations

import pytest

from tests.helpers import engine
from vllm_ext.assets import model_path

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
]
MAX_TOKENS = 24


def _chat_ids(tokenizer, prompt: str) -> list[int]:
    messages = [{"role": "user", "content": prompt}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


@pytest.fixture(scope="module")
def prompts_ids():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path("smollm2"))
    return [_chat_ids(tokenizer, p) for p in PROMPTS]


@pytest.fixture(scope="module")
def transformers_tokens(prompts_ids):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path("smollm2"), dtype=torch.float32)
    outs = []
    for ids in prompts_ids:
        with torch.no_grad():
            gen = model.generate(
                torch.tensor([ids]),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        outs.append(gen[0, len(ids) :].tolist())
    return outs


def test_vllm_greedy_equals_transformers(prompts_ids, transformers_tokens):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with engine("smollm2", dtype="float32") as llm:
        outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts_ids], params)
    vllm_tokens = [list(o.outputs[0].token_ids) for o in outs]
    assert vllm_tokens == transformers_tokens


def test_smollm2_answers_sensibly(prompts_ids, transformers_tokens):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path("smollm2"))
    assert "Paris" in tokenizer.decode(transformers_tokens[0])
