"""Flide vs what a vLLM user does today: many yes/no questions over one shared context.

Workloads (:mod:`benchmarks.flide.workloads`): BFCL tool schemas + user
turns ("does this request need a tool call?"), swept over questions per
context and context length; a few-shot header + ShareGPT messages; a long
ShareGPT conversation + short questions. Labels `` yes`` / `` no``. Model: the
tiny Qwen3-Next hybrid (Gated DeltaNet + attention, bf16, CPU). Variants, on
the same questions in one run:

- ``vllm_apc``: one request per question, context as a shared prefix, prefix
  caching on (the context already cached by a warm-up: vLLM's best case), one
  generated token restricted to the labels, with logprobs;
- ``vllm_no_apc``: the same without prefix caching;
- ``naive_packing``: context and all questions in one causal sequence, read at
  each question's end (no masks, no state restart: shows the drift);
- ``flide``: one packed pass, masked attention, GDN restarted per question.

Metrics: questions/s and seconds per batch (median of ``--repeats`` timed runs,
each run's questions/s kept for the headline's spread), tokens
computed per batch, and agreement of each variant's classes with separate
computation (``vllm_no_apc`` is that computation); for naive packing, the
largest label log-probability drift from Flide (which equals separate
computation, tested). Headline: Flide vs ``vllm_apc`` questions/s at 64 BFCL
questions per 1024-token context (target ≥ 9.5×).

Run: ``python -m benchmarks.flide [--quick]`` (~3 min on 2 cores).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from tqdm import tqdm  # noqa: E402
from vllm.distributed.parallel_state import cleanup_dist_env_and_memory  # noqa: E402

from benchmarks.flide.workloads import build  # noqa: E402
from vllm_ext.assets import model_path  # noqa: E402
from vllm_ext.bench import (  # noqa: E402
    OUT_DIR,
    BenchResult,
    collect_fingerprint,
    command_line,
    headline_from_rounds,
    headline_text,
    write_result,
)
from vllm_ext.flide.classifier import WORKER_EXTENSION, PackedClassifier  # noqa: E402

NAME = "flide"
MODEL = "tiny-hybrid"
LABELS = [" yes", " no"]
HEADLINE_POINT = ("bfcl", 64, 1024)
ENGINE = dict(dtype="bfloat16", enforce_eager=True, kv_cache_memory_bytes=1 << 30,
              max_model_len=4096, seed=0, max_num_batched_tokens=8192)  # fmt: skip


def time_it(fn, repeats: int):
    """Median seconds of ``repeats`` calls, every call's seconds, the last output."""
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), times, out


def run_vllm(llm, ctx, questions, label_first, repeats):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, temperature=0.0, allowed_token_ids=label_first,
                            logprobs=len(label_first))  # fmt: skip
    prompts = [TokensPrompt(prompt_token_ids=ctx + q) for q in questions]
    llm.generate(prompts[:1], params, use_tqdm=False)  # warm: the context is now cached
    secs, runs, outs = time_it(lambda: llm.generate(prompts, params, use_tqdm=False), repeats)
    classes = [label_first.index(o.outputs[0].token_ids[0]) for o in outs]
    cached = outs[-1].num_cached_tokens or 0
    tokens = sum(len(ctx) + len(q) for q in questions) - cached * len(questions)
    return secs, runs, classes, tokens


def run_packed(llm, ctx, questions, repeats, isolate: bool):
    clf = PackedClassifier(llm, LABELS)
    payload = {"items": [[ctx, questions]], "labels": [list(x) for x in clf.label_ids],
               "isolate": isolate}  # fmt: skip

    def classify():
        return llm.collective_rpc("flide_classify", args=(payload,))[0]

    secs, runs, logp = time_it(classify, repeats)
    classes = [max(range(len(row)), key=row.__getitem__) for row in logp]
    return secs, runs, classes, len(ctx) + sum(len(q) for q in questions), logp


def agreement(a, b):
    return sum(x == y for x, y in zip(a, b, strict=True)) / len(a)


def point_name(workload: str, nq: int, nctx: int) -> str:
    return f"{workload} {nq}q/{nctx}t"


def measure(llm, variants, points, tok, label_first, repeats, desc) -> dict[str, list[dict]]:
    """Run every variant on every (workload, questions, context tokens) point on one engine."""
    rows: dict[str, list[dict]] = {name: [] for name in variants}
    for workload, nq, nctx in tqdm(points, desc=desc):
        ctx, qs = build(workload, nq, nctx, tok)
        for name in variants:
            if name.startswith("vllm"):
                secs, runs, classes, tokens = run_vllm(llm, ctx, qs, label_first, repeats)
                logp = None
            else:
                secs, runs, classes, tokens, logp = run_packed(
                    llm, ctx, qs, repeats, name == "flide"
                )
            rows[name].append({"point": point_name(workload, nq, nctx), "workload": workload,
                               "questions_per_context": nq, "context_tokens": len(ctx),
                               "questions_per_s": nq / secs, "seconds_per_batch": secs,
                               "questions_per_s_runs": [nq / t for t in runs],
                               "tokens_computed": tokens, "classes": classes,
                               "logprobs": logp})  # fmt: skip
    return rows


def engine(**kwargs):
    from vllm import LLM

    return LLM(model=str(model_path(MODEL)), worker_extension_cls=WORKER_EXTENSION,
               **ENGINE, **kwargs)  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer points (and 1 repeat)")
    parser.add_argument("--repeats", type=int, help="timed runs per point (default 3; quick 1)")
    parser.add_argument("--out", default=OUT_DIR)
    args = parser.parse_args(argv)
    args.argv = argv
    repeats = args.repeats or (1 if args.quick else 3)
    args.repeats = repeats
    sweep_q = [4, 64] if args.quick else [1, 4, 16, 64, 256]
    sweep_ctx = [1024] if args.quick else [512, 1024, 2048]
    points = [("bfcl", q, 1024) for q in sweep_q]
    points += [("bfcl", 64, c) for c in sweep_ctx if c != 1024]
    points += [("fewshot", 64, 1024)] + ([] if args.quick else [("sharegpt", 64, 2048)])
    llm = engine(enable_prefix_caching=True)
    tok = llm.get_tokenizer()
    label_first = [tok.encode(label, add_special_tokens=False)[0] for label in LABELS]
    rows = measure(llm, ("vllm_apc", "naive_packing", "flide"), points, tok, label_first,
                   repeats, "flide bench (prefix caching on)")  # fmt: skip
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()
    llm = engine(enable_prefix_caching=False)
    rows |= measure(llm, ("vllm_no_apc",), points, tok, label_first, repeats,
                    "flide bench (prefix caching off)")  # fmt: skip
    result = build_result(rows, points, args)
    write_result(result, args.out)
    h = result.headline
    sys.stdout.write(headline_text(h, "flide"))
    return 0


VARIANT_METHODS = {
    "vllm_apc": ("one request per question (LLM.generate)", True, None),
    "naive_packing": ("one packed pass, plain causal attention", True, False),
    "flide": ("one packed pass, masked attention, GDN restarted per question", True, True),
    "vllm_no_apc": ("one request per question (LLM.generate)", False, None),
}


def variant_configs() -> dict[str, dict]:
    """Engine arguments and method of every variant (vLLM is called in-process, offline API)."""
    return {
        name: {
            "method": method,
            "engine": {"model": MODEL, **ENGINE, "enable_prefix_caching": apc},
            "worker_extension_cls": WORKER_EXTENSION,
            **({"isolate": isolate} if isolate is not None else {}),
        }
        for name, (method, apc, isolate) in VARIANT_METHODS.items()
    }


def build_result(rows, points, args) -> BenchResult:
    exact = [point["classes"] for point in rows["vllm_no_apc"]]
    # Flide equals separate computation (tests/engine/test_flide_engine.py): naive packing's
    # distance from it is the drift that questions seeing each other cause
    flide_logp = [point["logprobs"] for point in rows["flide"]]
    for series in rows.values():
        for point, ref, ref_logp in zip(series, exact, flide_logp, strict=True):
            point["class_agreement_vs_separate"] = agreement(point.pop("classes"), ref)
            logp = point.pop("logprobs")
            if logp is not None:
                point["max_logprob_drift_vs_flide"] = max(
                    abs(a - b) for row, ref_row in zip(logp, ref_logp, strict=True)
                    for a, b in zip(row, ref_row, strict=True)
                )  # fmt: skip
    head_index = points.index(HEADLINE_POINT)
    top = {name: {k: v for k, v in series[head_index].items()} for name, series in rows.items()}
    return BenchResult(
        name=NAME,
        description=__doc__.split("\n\n")[0],
        variants=top,
        # timed runs of one variant follow each other, not paired with the baseline's
        headline=headline_from_rounds(
            "questions_per_s",
            top["flide"]["questions_per_s_runs"],
            top["vllm_apc"]["questions_per_s_runs"],
            "vllm_apc",
            higher_is_better=True,
            target=9.5,
            paired=False,
        ),  # fmt: skip
        fingerprint=collect_fingerprint(),
        command=command_line("benchmarks.flide", args.argv),
        variant_configs=variant_configs(),
        config={
            "model": MODEL,
            "labels": LABELS,
            "engine": ENGINE,
            "repeats": args.repeats,
            "quick": args.quick,
            "points": points,
        },  # fmt: skip
        series={name: [dict(p) for p in series] for name, series in rows.items()},
        sweep_axis="point",
        plot_metric="questions_per_s",
    )


if __name__ == "__main__":
    sys.exit(main())
