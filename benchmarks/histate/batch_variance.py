"""Are the tiny hybrid's greedy outputs batch-invariant on this CPU? (context for histate_engine)

The same 12 random prompts are decoded greedily (32 tokens, no prefix cache)
one at a time and then as one batch; the count of identical outputs is
printed. bf16 kernels whose reductions depend on the batch make some differ,
which is why the engine benchmark compares only first-turn outputs with
native's and leaves exactness to the isolated-request engine tests.

Run: ``python -m benchmarks.histate.batch_variance`` (~1 min).
"""

from __future__ import annotations

import os
import sys

import numpy as np

from benchmarks.histate.serve_trace import MAX_MODEL_LEN


def main() -> int:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    from vllm_ext.assets import model_path

    rng = np.random.default_rng
    prompts = [rng(i).integers(100, 30000, size=900 + 37 * i).tolist() for i in range(12)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    llm = LLM(
        model=str(model_path("tiny-hybrid")), enforce_eager=True, seed=0,
        enable_prefix_caching=False, max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=1536, kv_cache_memory_bytes=64 << 20,
    )  # fmt: skip
    inputs = [{"prompt_token_ids": p} for p in prompts]
    alone = [llm.generate([x], params, use_tqdm=False)[0].outputs[0].token_ids for x in inputs]
    batch = [o.outputs[0].token_ids for o in llm.generate(inputs, params, use_tqdm=False)]
    same = sum(list(a) == list(b) for a, b in zip(alone, batch, strict=True))
    sys.stdout.write(f"identical greedy outputs alone vs batched: {same} of {len(prompts)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
