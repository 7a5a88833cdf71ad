"""Decode tokens/s in vLLM CPU: bf16 SmolLM2 vs a TVQ checkpoint (kernel, and reference apply).

Each variant runs in its own process (the kernel choice is read when the
engine builds the model), same prompts, greedy, ``--rounds`` rounds; the
output is the median and spread of generated tokens per wall second.
``python -m benchmarks.tvq.decode --ckpt DIR [--rounds 3] [--tokens 32]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPTS = ["Explain how a bicycle works.", "Write a short poem about rain.",
           "What is the capital of Spain?", "List three uses of copper."]  # fmt: skip


def _child(model: str, tokens: int, rounds: int) -> None:
    import torch

    torch.set_num_threads(int(os.environ.get("TVQ_THREADS", "1")))
    from vllm import LLM, SamplingParams

    from vllm_ext.tvq import plugin

    plugin.register()
    llm = LLM(model=model, dtype="bfloat16", enforce_eager=True, max_model_len=512,
              max_num_seqs=1, seed=0)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2))
    rates = []
    for _ in range(rounds):
        start = time.perf_counter()
        outs = llm.generate(PROMPTS, params)
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        rates.append(n / (time.perf_counter() - start))
    print("RESULT " + json.dumps(rates))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", type=Path)
    p.add_argument("--base", default=None)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--child", default=None)
    p.add_argument("--out", type=Path, default=Path("benchmarks/out/tvq_kernel.json"))
    a = p.parse_args()
    if a.child:
        _child(a.child, a.tokens, a.rounds)
        return
    from vllm_ext.assets import model_path

    base = a.base or str(model_path("smollm2"))
    variants = {"bf16": (base, "8"), "tvq_kernel": (str(a.ckpt), "8"),
                "tvq_reference_apply": (str(a.ckpt), "0")}  # fmt: skip
    result = {}
    for name, (model, kernel_tokens) in variants.items():
        env = {**os.environ, "VLLMEXT_TVQ_MAX_KERNEL_TOKENS": kernel_tokens,
               "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # fmt: skip
        cmd = [sys.executable, "-m", "benchmarks.tvq.decode", "--child", model,
               "--tokens", str(a.tokens), "--rounds", str(a.rounds)]  # fmt: skip
        out = subprocess.run(cmd, env=env, capture_output=True, text=True)
        line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
        if not line:
            raise SystemExit(f"{name} failed:\n{out.stderr[-3000:]}")
        rates = json.loads(line[-1][7:])
        result[name] = {"median_tok_s": statistics.median(rates), "min": min(rates),
                        "max": max(rates), "rounds": rates}  # fmt: skip
        print(name, result[name], flush=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
