"""vLLM CPU decode tokens/s of sparse SmolLM2 (ETAPS format, our kernel) vs the dense bf16 model.

The 70 % and 90 % checkpoints are SmolLM2 pruned per row by magnitude and
exported with :func:`vllm_ext.etaps.export.export` (speed depends on the sparsity
and the format, not on which weights survive). Each variant runs in its own
process (one engine per process), same prompts, greedy, one sequence at a time
(each decode step is a one-token call: the kernel path). Per round, decode
tokens/s = ``prompts × (tokens − 1) / (t(tokens) − t(1))``: the prefill and first
token are timed separately and subtracted. Median and spread of ``--rounds``.

    python -m benchmarks.etaps.kernel [--rounds 3] [--tokens 48] [--out benchmarks/out]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

PROMPTS = ["Explain how a bicycle works.", "Write a short poem about rain.",
           "What is the capital of Spain?", "List three uses of copper."]  # fmt: skip
CACHE = Path.home() / ".cache" / "vllm_ext" / "etaps"


def _child(model: str, tokens: int, rounds: int) -> None:
    import torch

    torch.set_num_threads(int(os.environ.get("ETAPS_BENCH_THREADS", "2")))
    from vllm import LLM, SamplingParams

    from vllm_ext.etaps import plugin

    plugin.register()
    llm = LLM(model=model, dtype="bfloat16", enforce_eager=True, max_model_len=512,
              max_num_seqs=1, seed=0, kv_cache_memory_bytes=256 << 20)  # fmt: skip
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    full = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4))  # warm-up
    rates = []
    for _ in range(rounds):
        start = time.perf_counter()
        llm.generate(PROMPTS, first, use_tqdm=False)
        t_first = time.perf_counter() - start
        start = time.perf_counter()
        outs = llm.generate(PROMPTS, full, use_tqdm=False)
        t_full = time.perf_counter() - start
        decoded = sum(len(o.outputs[0].token_ids) - 1 for o in outs)
        rates.append(decoded / max(t_full - t_first, 1e-9))
    print("RESULT " + json.dumps(rates), flush=True)


def sparse_checkpoint(base: Path, sparsity: float) -> Path:
    """SmolLM2 pruned per row by magnitude to ``sparsity``, exported once (cached)."""
    from vllm_ext.etaps.baselines import prune_one_shot
    from vllm_ext.etaps.export import export
    from vllm_ext.etaps.model_io import load_model

    out = CACHE / f"{base.name}-magnitude-{round(sparsity * 100)}"
    if not (out / "model.safetensors").exists():
        model, _ = load_model(base)
        prune_one_shot(model, sparsity)
        export(model, base, out, sparsity)
    return out


def _measure(name: str, model: Path, args) -> list[float]:
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "VLLMEXT_ETAPS_MAX_SPARSE_TOKENS": "8"}  # fmt: skip
    cmd = [sys.executable, "-m", "benchmarks.etaps.kernel", "--child", str(model),
           "--tokens", str(args.tokens), "--rounds", str(args.rounds)]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    line = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    if not line:
        raise SystemExit(f"{name} failed:\n{done.stderr[-3000:]}")
    return json.loads(line[-1][len("RESULT ") :])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.etaps.kernel", description=__doc__)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--sparsities", default="0.7,0.9")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--child", default=None)
    p.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    args = p.parse_args(argv)
    if args.child:
        _child(args.child, args.tokens, args.rounds)
        return 0
    from vllm_ext.assets import model_path
    from vllm_ext.bench import (
        BenchResult,
        collect_fingerprint,
        headline_from_rounds,
        spread,
        write_result,
    )
    from vllm_ext.kernels.sparse_gemv import compiled_available

    if not compiled_available():
        raise SystemExit("the sparse kernel does not build here: nothing to measure")
    base = model_path(args.model)
    sparsities = [float(s) for s in args.sparsities.split(",")]
    models = {"dense_bf16": base} | {
        f"etaps_{round(s * 100)}": sparse_checkpoint(base, s) for s in sparsities
    }
    rounds = {}
    for name, model in models.items():
        rounds[name] = _measure(name, model, args)
        print(name, rounds[name], file=sys.stderr, flush=True)
    top = f"etaps_{round(max(sparsities) * 100)}"
    headline = headline_from_rounds(
        f"vLLM CPU decode tokens/s, SmolLM2 at {max(sparsities):.0%} sparsity (our kernel) "
        "vs dense bf16, one sequence",
        rounds[top], rounds["dense_bf16"], "dense_bf16", higher_is_better=True,
        target=1.5, paired=False,
    )  # fmt: skip
    variants = {}
    dense = spread(rounds["dense_bf16"])["median"]
    for name, rates in rounds.items():
        s = spread(rates)
        variants[name] = {"decode_tok_s": s["median"], "min": s["min"], "max": s["max"],
                          "speedup": s["median"] / dense}  # fmt: skip
    result = BenchResult(
        name="etaps_kernel",
        description=__doc__.strip().splitlines()[0],
        variants=variants,
        headline=headline,
        fingerprint=collect_fingerprint(),
        plot_metric="decode_tok_s",
        config={
            "model": str(base),
            "checkpoints": {k: str(v) for k, v in models.items()},
            "prompts": PROMPTS,
            "tokens": args.tokens,
            "rounds": args.rounds,
            "max_sparse_tokens": 8,
            "enforce_eager": True,
            "host_note": "shared 2-core host under load (other sessions' benchmarks)",
        },  # fmt: skip
    )
    paths = write_result(result, args.out)
    print(f"ratio {headline['ratio']:.3f} -> {paths['json']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
