"""vLLM CPU serves an exported TVQ checkpoint; its prompt logprobs equal a torch forward.

The checkpoint is the tiny Llama asset with VQ MLPs (d=4, K=16, fused
gate_up_proj included). Both the compiled lookup-GEMV path and the
dequantize-and-matmul path are checked, in fp32, against the torch model
rebuilt from the same codes.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers import engine
from vllm_ext.assets import model_path
from vllm_ext.kernels.tvq_gemv import kernel_available
from vllm_ext.tvq.export import export, load_reference
from vllm_ext.tvq.format import QuantFormat
from vllm_ext.tvq.qat import quantize_mlps

PROMPTS = [[5, 17, 99, 3, 42, 8, 61, 77, 12, 4], [9, 9, 30, 2, 55, 71, 18]]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from vllm_ext.tvq import plugin

    plugin.register()  # the worktree's entry point is not installed in the test venv
    base = model_path("tiny-llama")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    quantize_mlps(model, 4, 16, kmeans_iters=3)
    return export(model, base, tmp_path_factory.mktemp("tvq") / "ckpt", QuantFormat(4, 16))


def _torch_logprobs(ckpt, ids):
    model = load_reference(ckpt)
    with torch.no_grad():
        logp = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    return [logp[i, ids[i + 1]].item() for i in range(len(ids) - 1)]


def _kernel_choices(model) -> set[tuple[int, str | None]]:
    """``(max_kernel_tokens, kernel)`` of every tvq-quantized layer of ``model``."""
    return {(m.quant_method.max_kernel_tokens, m.kernel)
            for m in model.modules() if hasattr(m, "codebook_f32")}  # fmt: skip


@pytest.mark.parametrize("kernel_tokens", [0, 64])
def test_vllm_prompt_logprobs_equal_torch(ckpt, kernel_tokens):
    """The kernel choice comes from ``--additional-config`` (no env var), both paths exact."""
    if kernel_tokens and not kernel_available():
        pytest.skip("no C++ compiler for the TVQ kernel")
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0)
    extra = {"tvq": {"max_kernel_tokens": kernel_tokens}}
    with engine(ckpt, dtype="float32", additional_config=extra) as llm:
        assert llm.llm_engine.vllm_config.model_config.quantization == "tvq"
        want = {(kernel_tokens, "cpu" if kernel_tokens else None)}
        assert llm.apply_model(_kernel_choices) == [want]
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params)
        got = [[next(iter(d.values())).logprob for d in o.prompt_logprobs[1:]] for o in outs]
    for ids, lp in zip(PROMPTS, got, strict=False):
        ref = _torch_logprobs(ckpt, ids)
        assert len(lp) == len(ref)
        assert max(abs(a - b) for a, b in zip(lp, ref, strict=False)) < 1e-3
        assert math.isfinite(sum(lp))
