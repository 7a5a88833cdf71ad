"""Flide's drift from fp32 truth, next to vLLM's own, per architecture and dtype.

For every architecture Flide packs (and each dtype vLLM's CPU ops run it in),
``--seeds`` random tiny models, each scored on random calls three ways
(:mod:`benchmarks.flide.exactness`): Flide, separate vLLM requests, and an
fp32 transformers forward of each lineage alone (the truth). Writes the worst
``|logprob - truth|`` of Flide and of vLLM, class agreement where the truth is
decided, and MoE routing agreement (Flide vs truth) to
``benchmarks/out/flide_drift.json``.

Run: ``python -m benchmarks.flide.drift [--seeds 3] [--long 4096]``. Qwen3.5
needs torchvision importable (vLLM's qwen3_5 module imports its image code);
architectures vLLM cannot import are recorded as skipped, with the reason.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from benchmarks.flide import exactness as ex  # noqa: E402

DTYPES = {True: ("bfloat16",), False: ("float32", "bfloat16")}  # hybrid: vLLM's CPU GDN is bf16
TOLERANCE = {"float32": 1e-3, "bfloat16": 0.05}
BUDGET = 2048


def measure(arch: ex.Arch, dtype: str, seed: int, long_context: int, workdir: Path) -> dict:
    path = workdir / f"{arch.name}-{dtype}-{seed}"
    fields = ex.build_model(arch, seed, path)
    truth_model = ex.load_truth_model(path)
    llm = ex.engine(path, dtype, long_context + 256)
    try:
        calls = ex.random_calls(seed, short=4, long_context=long_context)
        merged, _ = ex.run_calls(llm, truth_model, calls, dtype, TOLERANCE[dtype], BUDGET,
                                 arch.moe)  # fmt: skip
    finally:
        ex.close(llm)
    return merged | {"seed": seed, "config": fields}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3, help="random models per (arch, dtype)")
    parser.add_argument("--first-seed", type=int, default=7000)
    parser.add_argument("--long", type=int, default=4096, help="long-context call (0: none)")
    parser.add_argument("--arch", action="append", choices=sorted(ex.ARCHS))
    parser.add_argument("--out", default="benchmarks/out/flide_drift.json")
    args = parser.parse_args(argv)
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="flide-drift-") as tmp:
        for name in args.arch or list(ex.ARCHS):
            arch = ex.ARCHS[name]
            for dtype in DTYPES[arch.hybrid]:
                key = f"{name}/{dtype}"
                runs = []
                if name.startswith("qwen3.5") and importlib.util.find_spec("torchvision") is None:
                    # vLLM 0.32's qwen3_5 module imports qwen3_vl's image code
                    results[key] = {"skipped": "vLLM cannot import its qwen3_5 model without "
                                    "torchvision"}  # fmt: skip
                    continue
                try:
                    for n in range(args.seeds):
                        start = time.perf_counter()
                        run = measure(arch, dtype, args.first_seed + n, args.long, Path(tmp))
                        run["seconds"] = time.perf_counter() - start
                        runs.append(run)
                        print(key, {k: v for k, v in run.items() if k != "config"}, flush=True)
                except ModuleNotFoundError as exc:  # vLLM cannot import the model here
                    results[key] = {"skipped": f"{type(exc).__name__}: {exc}"}
                    continue
                results[key] = summary(arch, runs)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"description": __doc__.split("\n\n")[0], "budget": BUDGET,
              "long_context": args.long, "results": results}  # fmt: skip
    out.write_text(json.dumps(report, indent=2))
    sys.stdout.write(f"wrote {out}\n")
    return 0


def summary(arch: ex.Arch, runs: list[dict]) -> dict:
    out = {
        "architecture": arch.architecture,
        "models": len(runs),
        "rows": sum(r["rows"] for r in runs),
        "worst_flide_vs_truth": max(r["worst_flide_vs_truth"] for r in runs),
        "worst_vllm_vs_truth": max(r["worst_vllm_vs_truth"] for r in runs),
        "decided_rows": sum(r["decided_rows"] for r in runs),
        "flide_class_disagreements": sum(r["flide_class_disagreements"] for r in runs),
        "vllm_class_agreement": sum(r["vllm_class_agreement"] for r in runs),
        "runs": runs,
    }
    if arch.moe:
        out["routing_agreement_min"] = min(r["routing_agreement"] for r in runs)
    return out


if __name__ == "__main__":
    sys.exit(main())
