"""Decode tokens/s in vLLM CPU: bf16 SmolLM2 vs a TVQ checkpoint (kernel, and reference apply).

Each variant runs in its own process, one after the other (two engines do not
share a process), on the same prompts, greedy, one sequence at a time
(``max_num_seqs=1``: decode batches of one token, the memory-bound case), for
``--rounds`` rounds after a warm-up; ``tvq_kernel`` sets
``{"tvq": {"max_kernel_tokens": 8}}``, ``tvq_reference_apply`` ``0`` (dequantize
every weight each call, the anchors' CPU path). Headline: median generated
tokens per wall second of ``tvq_kernel`` vs ``bf16`` (target >= 1.0).
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


def _child(model: str, tokens: int, rounds: int, kernel_tokens: int) -> None:
    import torch

    torch.set_num_threads(int(os.environ.get("TVQ_THREADS", "1")))
    from vllm import LLM, SamplingParams

    from vllm_ext.tvq import plugin

    plugin.register()
    llm = LLM(model=model, dtype="bfloat16", enforce_eager=True, max_model_len=512,
              max_num_seqs=1, seed=0, kv_cache_memory_bytes=256 << 20,
              additional_config={"tvq": {"max_kernel_tokens": kernel_tokens}})  # fmt: skip
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
    p.add_argument("--kernel-tokens", type=int, default=8)
    p.add_argument("--variants", default="bf16,tvq_kernel,tvq_reference_apply")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--name", default="tvq_kernel")
    p.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    a = p.parse_args()
    if a.child:
        _child(a.child, a.tokens, a.rounds, a.kernel_tokens)
        return
    from vllm_ext.assets import model_path
    from vllm_ext.bench import BenchResult, collect_fingerprint, headline_from_rounds, write_result

    name = a.base or "smollm2"
    base = name if Path(name).is_dir() else str(model_path(name))
    variants = {"bf16": (base, "8"), "tvq_kernel": (str(a.ckpt), "8"),
                "tvq_reference_apply": (str(a.ckpt), "0")}  # fmt: skip
    variants = {k: v for k, v in variants.items() if k in a.variants.split(",")}
    result = {}
    for name, (model, kernel_tokens) in variants.items():
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
               "TVQ_THREADS": str(a.threads)}  # fmt: skip
        cmd = [sys.executable, "-m", "benchmarks.tvq.decode", "--child", model,
               "--tokens", str(a.tokens), "--rounds", str(a.rounds),
               "--kernel-tokens", kernel_tokens]  # fmt: skip
        out = subprocess.run(cmd, env=env, capture_output=True, text=True)
        line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
        if not line:
            raise SystemExit(f"{name} failed:\n{out.stderr[-3000:]}")
        rates = json.loads(line[-1][7:])
        result[name] = {"median_tok_s": statistics.median(rates), "min": min(rates),
                        "max": max(rates), "rounds": rates}  # fmt: skip
        print(name, result[name], flush=True)
    headline = headline_from_rounds(
        f"vLLM CPU decode tokens/s (bf16 activations, 1 sequence, {a.tokens} tokens x "
        f"{len(PROMPTS)} prompts per round): TVQ lookup-GEMV kernel vs the bf16 model",
        result["tvq_kernel"]["rounds"],
        result["bf16"]["rounds"],
        "bf16",
        higher_is_better=True,
        target=1.0,
        paired=False,  # the variants ran one after the other, not round-robin
    )
    fmt = json.loads((Path(a.ckpt) / "config.json").read_text())["quantization_config"]
    write_result(BenchResult(
        name=a.name, description=__doc__.strip().splitlines()[0],
        variants=result, headline=headline, fingerprint=collect_fingerprint(),
        config={"ckpt": str(a.ckpt), "base": base, "quantization_config": fmt,
                "tokens": a.tokens, "prompts": PROMPTS, "rounds": a.rounds,
                "threads": a.threads, "max_num_seqs": 1},
        plot_metric="median_tok_s",
    ), a.out)  # fmt: skip
    print(headline)


if __name__ == "__main__":
    main()
