"""TVQ at tensor parallel 2 (two CPU workers): prompt logprobs equal the torch forward.

Each rank loads its shard of the VQ codes: column-parallel layers (fused
gate_up_proj) their output rows, the row-parallel down_proj its input
columns (whole vectors: vec_dim 4 divides each rank's 128 columns), with the
shared codebooks and per-row scales whole; the row-parallel all-reduce sums
the ranks' partial products. Same checkpoint and tolerance as
``test_tvq_engine.py``, on the compiled lookup-GEMV path (dequantize-and-matmul
where no compiler is available).
"""

from __future__ import annotations

import math

import pytest

from tests.engine.test_tvq_engine import (
    PROMPTS,
    _kernel_choices,
    _torch_logprobs,
    ckpt,  # noqa: F401  (module fixture)
)
from tests.engine.tp2 import tp2_engine
from vllm_ext.kernels.tvq_gemv import kernel_available

pytestmark = pytest.mark.tp2


def test_vllm_prompt_logprobs_at_tensor_parallel_2_equal_torch(ckpt):  # noqa: F811
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    kernel_tokens = 64 if kernel_available() else 0
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0)
    extra = {"tvq": {"max_kernel_tokens": kernel_tokens}}
    with tp2_engine(ckpt, dtype="float32", additional_config=extra) as llm:
        want = {(kernel_tokens, "cpu" if kernel_tokens else None)}
        assert llm.apply_model(_kernel_choices) == [want, want]  # one answer per rank
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params)
        got = [[next(iter(d.values())).logprob for d in o.prompt_logprobs[1:]] for o in outs]
    for ids, lp in zip(PROMPTS, got, strict=True):
        ref = _torch_logprobs(ckpt, ids)
        assert len(lp) == len(ref)
        assert max(abs(a - b) for a, b in zip(lp, ref, strict=True)) < 1e-3
        assert math.isfinite(sum(lp))
