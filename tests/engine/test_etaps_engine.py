"""vLLM CPU serves an exported ETAPS sparse checkpoint; its prompt logprobs equal a torch forward.

The checkpoint is the tiny Llama asset pruned per row to 70 % (fused qkv_proj and
gate_up_proj included). Three paths run in fp32 against the torch model with the
masked dense weights: the compiled row-sparse kernel, the per-call dense
fallback (``max_sparse_tokens=0``) and the load-time densification below
``min_kernel_sparsity``.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers import engine
from vllm_ext.assets import model_path
from vllm_ext.etaps.baselines import prune_one_shot
from vllm_ext.etaps.export import export, load_reference
from vllm_ext.kernels.sparse_gemv import compiled_available

PROMPTS = [[5, 17, 99, 3, 42, 8, 61, 77, 12, 4], [9, 9, 30, 2, 55, 71, 18]]
SPARSITY = 0.7


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from vllm_ext.etaps import plugin

    plugin.register()  # in-process engines: what vllm_ext.plugin:register does in vLLM
    base = model_path("tiny-llama")
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    prune_one_shot(model, SPARSITY)
    return export(model, base, tmp_path_factory.mktemp("etaps") / "ckpt", SPARSITY)


def _torch_logprobs(ckpt, ids):
    model = load_reference(ckpt)
    with torch.no_grad():
        logp = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    return [logp[i, ids[i + 1]].item() for i in range(len(ids) - 1)]


def _kernel_layers(model) -> int:
    return sum(bool(getattr(m, "use_kernel", False)) for m in model.modules())


@pytest.mark.parametrize(
    ("max_sparse_tokens", "min_kernel_sparsity", "kernel"),
    [(64, 0.5, True), (0, 0.5, False), (64, 0.9, False)],
    ids=["kernel", "dense-per-call", "densified-at-load"],
)
def test_vllm_prompt_logprobs_equal_masked_dense_torch(
    ckpt, max_sparse_tokens, min_kernel_sparsity, kernel, monkeypatch
):
    if kernel and not compiled_available():
        pytest.skip("no C++ compiler for the sparse kernel")
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    monkeypatch.setenv("VLLMEXT_ETAPS_MAX_SPARSE_TOKENS", str(max_sparse_tokens))
    monkeypatch.setenv("VLLMEXT_ETAPS_MIN_KERNEL_SPARSITY", str(min_kernel_sparsity))
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0)
    with engine(ckpt, dtype="float32") as llm:
        assert llm.llm_engine.vllm_config.model_config.quantization == "etaps"
        (n_kernel,) = llm.apply_model(_kernel_layers)
        assert (n_kernel > 0) == kernel
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params)
        got = [[next(iter(d.values())).logprob for d in o.prompt_logprobs[1:]] for o in outs]
    for ids, lp in zip(PROMPTS, got, strict=True):
        ref = _torch_logprobs(ckpt, ids)
        assert len(lp) == len(ref)
        assert max(abs(a - b) for a, b in zip(lp, ref, strict=True)) < 1e-4
        assert math.isfinite(sum(lp))
