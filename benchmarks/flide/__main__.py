"""Flide vs vLLM at its best: many yes/no questions over one shared context.

Workload (:mod:`benchmarks.flide.workloads`): BFCL tool schemas as the
context, BFCL user turns as questions ("does this request need a tool
call?"), swept over questions per context (``--questions``) and context
length (``--contexts``). Labels `` yes`` / `` no``. Model: the tiny Qwen3-Next
hybrid (Gated DeltaNet + attention, bf16, CPU). Variants, on the same
questions in one run:

- ``vllm_apc``: one request per question, all in one ``LLM.generate`` call,
  prefix caching on at the smallest block size vLLM accepts for the model
  (``block_size=16`` asked; vLLM's hybrid align mode raises it so an
  attention page holds the GDN state: 544 tokens), the context cached by a
  warm-up request, one generated token restricted to the labels;
- ``vllm_apc_bf16_state``: the same with the GDN state cached in bf16
  (``mamba_ssm_cache_dtype=bfloat16``, lossy), which halves the state page
  and lets vLLM take 288-token blocks: the fastest vLLM setting found;
- ``vllm_batch``: the context once plus the ``n`` questions as one batch of
  requests, prefix cache emptied before each round (nothing warmed up), on the
  ``vllm_apc_bf16_state`` engine;
- ``flide``: packed passes (masked attention, GDN restarted per question),
  split at the engine's ``max_num_batched_tokens`` as the server splits them.

Metrics: questions/s (median of ``--repeats`` rounds, every round kept),
tokens computed per round (vLLM: prompt tokens minus prefix-cache hits; Flide:
packed tokens), and agreement of each variant's classes with ``vllm_apc``'s.
Headline: Flide vs the fastest vLLM variant at 64 questions per 1024-token
context (target >= 9.5x); ``ratio @<ctx>t`` series plot the ratio over the grid.

Run: ``python -m benchmarks.flide [--quick]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

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
from vllm_ext.flide.classifier import RPC_METHOD, WORKER_EXTENSION  # noqa: E402
from vllm_ext.flide.config import FlideConfig  # noqa: E402
from vllm_ext.flide.plan import Question, engine_step_tokens, pass_budget, plan_passes  # noqa: E402

NAME = "flide"
MODEL = "tiny-hybrid"
LABELS = [" yes", " no"]
HEADLINE = (64, 1024)
DRIFT_FILE = Path("benchmarks/out/flide_drift.json")
ENGINE = dict(dtype="bfloat16", enforce_eager=True, kv_cache_memory_bytes=1 << 30,
              max_model_len=4608, seed=0, max_num_batched_tokens=8192,
              enable_prefix_caching=True, block_size=16)  # fmt: skip
# engine arguments per vLLM variant on top of ENGINE; flide runs on the first engine
ENGINES = {
    "vllm_apc": {},
    "vllm_apc_bf16_state": {"mamba_ssm_cache_dtype": "bfloat16"},
}
VARIANT_ENGINE = {"vllm_apc": "vllm_apc", "flide": "vllm_apc",
                  "vllm_apc_bf16_state": "vllm_apc_bf16_state",
                  "vllm_batch": "vllm_apc_bf16_state"}  # fmt: skip
VLLM_VARIANTS = ("vllm_apc", "vllm_apc_bf16_state", "vllm_batch")


def rounds(fn, repeats: int, before=None):
    """Every round's seconds and the last round's output (``before`` runs untimed first)."""
    times, out = [], None
    for _ in range(repeats):
        if before is not None:
            before()
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return times, out


def run_vllm(llm, ctx, questions, label_first, repeats, warm: bool):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, temperature=0.0, allowed_token_ids=label_first,
                            logprobs=len(label_first))  # fmt: skip
    prompts = [TokensPrompt(prompt_token_ids=ctx + q) for q in questions]
    if warm:

        def warm_up():  # every round from the context alone in the cache
            llm.reset_prefix_cache()
            llm.generate(prompts[:1], params, use_tqdm=False)

        times, outs = rounds(lambda: llm.generate(prompts, params, use_tqdm=False), repeats,
                             before=warm_up)  # fmt: skip
    else:
        # the context once, then the questions, in one batch from an empty prefix cache
        batch = [TokensPrompt(prompt_token_ids=ctx)] + prompts
        times, outs = rounds(lambda: llm.generate(batch, params, use_tqdm=False), repeats,
                             before=llm.reset_prefix_cache)  # fmt: skip
        outs = outs[1:]
    classes = [label_first.index(o.outputs[0].token_ids[0]) for o in outs]
    tokens = sum(len(o.prompt_token_ids) - (o.num_cached_tokens or 0) for o in outs)
    if not warm:
        tokens += len(ctx)
    return times, classes, tokens


def run_flide(llm, ctx, questions, label_ids, repeats):
    budget = pass_budget(FlideConfig(), engine_step_tokens(llm.llm_engine.vllm_config))
    asked = [Question(0, str(n), tuple(q)) for n, q in enumerate(questions)]
    passes = plan_passes([tuple(ctx)], asked, label_ids, budget)
    labels = [list(x) for x in label_ids]

    def classify():
        logp = []
        for packed in passes:
            payload = {"items": packed.items, "labels": labels}
            logp += llm.collective_rpc(RPC_METHOD, args=(payload,))[0]
        return logp

    times, logp = rounds(classify, repeats)
    classes = [max(range(len(row)), key=row.__getitem__) for row in logp]
    tokens = sum(len(c) + sum(len(q) for q in qs) for p in passes for c, qs in p.items)
    return times, classes, tokens, len(passes)


def engine(extra: dict):
    from vllm import LLM

    return LLM(model=str(model_path(MODEL)), worker_extension_cls=WORKER_EXTENSION,
               **ENGINE, **extra)  # fmt: skip


def block_size(llm) -> int:
    return int(llm.llm_engine.vllm_config.cache_config.block_size)


def measure(variants, points, repeats) -> tuple[dict, dict]:
    """``{variant: {(q, ctx): row}}`` and each engine's block size, engine by engine."""
    rows: dict[str, dict] = {name: {} for name in variants}
    blocks = {}
    for engine_name, extra in ENGINES.items():
        names = [v for v in variants if VARIANT_ENGINE[v] == engine_name]
        if not names:
            continue
        llm = engine(extra)
        blocks[engine_name] = block_size(llm)
        tok = llm.get_tokenizer()
        label_ids = [tuple(tok.encode(x, add_special_tokens=False)) for x in LABELS]
        label_first = [x[0] for x in label_ids]
        # one untimed round of every variant first: a fresh engine's first calls pay one-time
        # costs (kernel selection for new shapes) that no round should carry (with one point,
        # its median of 3 rounds drops them instead)
        for warm_q, warm_ctx in points[:1] if len(points) > 1 else ():
            ctx, qs = build("bfcl", warm_q, warm_ctx, tok)
            for name in names:
                if name == "flide":
                    run_flide(llm, ctx, qs, label_ids, 1)
                else:
                    run_vllm(llm, ctx, qs, label_first, 1, name != "vllm_batch")
        for nq, nctx in tqdm(points, desc=f"flide bench ({engine_name} engine)"):
            ctx, qs = build("bfcl", nq, nctx, tok)
            for name in names:
                passes = None
                if name == "flide":
                    times, classes, tokens, passes = run_flide(llm, ctx, qs, label_ids, repeats)
                else:
                    warm = name != "vllm_batch"
                    times, classes, tokens = run_vllm(llm, ctx, qs, label_first, repeats, warm)
                rows[name][(nq, nctx)] = {
                    "questions_per_context": nq, "context_tokens": len(ctx),
                    "questions_per_s": nq / statistics.median(times),
                    "questions_per_s_runs": [nq / t for t in times],
                    "seconds_per_round": statistics.median(times),
                    "tokens_computed": tokens, "classes": classes,
                    **({"passes": passes} if passes is not None else {}),
                }  # fmt: skip
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()
    return rows, blocks


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="the headline point only (1 round unless --repeats)"
    )
    parser.add_argument("--questions", default="4,16,64,256", help="questions per context")
    parser.add_argument("--contexts", default="512,1024,4096", help="context tokens")
    parser.add_argument("--extra-points", default="",
                        help="more QxCTX points, comma-separated")  # fmt: skip
    parser.add_argument("--repeats", type=int, help="timed rounds per point (default 3; quick 1)")
    parser.add_argument("--out", default=OUT_DIR)
    args = parser.parse_args(argv)
    args.argv = argv
    args.repeats = args.repeats or (1 if args.quick else 3)
    if args.quick:
        points = [HEADLINE]
    else:
        points = [(int(q), int(c)) for c in args.contexts.split(",")
                  for q in args.questions.split(",")]  # fmt: skip
        points += [tuple(int(x) for x in p.split("x")) for p in args.extra_points.split(",") if p]
        if HEADLINE not in points:
            points.append(HEADLINE)
    rows, blocks = measure((*VLLM_VARIANTS, "flide"), points, args.repeats)
    result = build_result(rows, blocks, points, args)
    write_result(result, args.out)
    sys.stdout.write(headline_text(result.headline, "flide"))
    return 0


VARIANT_METHODS = {
    "vllm_apc": "one request per question (LLM.generate), context cached by a warm-up",
    "vllm_apc_bf16_state": "as vllm_apc, GDN state cached in bf16 (smaller blocks)",
    "vllm_batch": "context once + the questions as one batch, prefix cache emptied first",
    "flide": "packed passes at max_num_batched_tokens, masked attention, GDN restarted",
}


def variant_configs(blocks: dict) -> dict[str, dict]:
    """Engine arguments and method of every variant (vLLM is called in-process, offline API)."""
    return {
        name: {
            "method": method,
            "engine": {"model": MODEL, **ENGINE, **ENGINES[VARIANT_ENGINE[name]]},
            "block_size_vllm_chose": blocks.get(VARIANT_ENGINE[name]),
            "worker_extension_cls": WORKER_EXTENSION,
        }
        for name, method in VARIANT_METHODS.items()
    }


def best_vllm(rows, point) -> str:
    return max(VLLM_VARIANTS, key=lambda v: rows[v][point]["questions_per_s"])


def build_result(rows, blocks, points, args) -> BenchResult:
    reference = {p: rows["vllm_apc"][p]["classes"] for p in points}
    for series in rows.values():
        for p, row in series.items():
            classes = row.pop("classes")
            row["class_agreement_vs_vllm_apc"] = sum(
                a == b for a, b in zip(classes, reference[p], strict=True)
            ) / len(classes)
    series: dict[str, list[dict]] = {}
    for p in points:
        best = best_vllm(rows, p)
        flide, base = rows["flide"][p], rows[best][p]
        ratio_row = {"questions_per_context": p[0], "context_tokens": p[1], "best_vllm": best,
                     "ratio_vs_best_vllm": flide["questions_per_s"] / base["questions_per_s"],
                     "tokens_computed_ratio": base["tokens_computed"]
                     / flide["tokens_computed"]}  # fmt: skip
        series.setdefault(f"ratio @{p[1]}t", []).append(ratio_row)
        for name in rows:
            series.setdefault(f"{name} @{p[1]}t", []).append(dict(rows[name][p]))
    best = best_vllm(rows, HEADLINE)
    top = {name: dict(rows[name][HEADLINE]) for name in rows}
    drift = json.loads(DRIFT_FILE.read_text()) if DRIFT_FILE.exists() else None
    return BenchResult(
        name=NAME,
        description=__doc__.split("\n\n")[0],
        variants=top,
        # rounds of one variant follow each other, not paired with the baseline's
        headline=headline_from_rounds(
            "questions_per_s",
            top["flide"]["questions_per_s_runs"],
            top[best]["questions_per_s_runs"],
            best,
            higher_is_better=True,
            target=9.5,
            paired=False,
        ),
        fingerprint=collect_fingerprint(),
        command=command_line("benchmarks.flide", args.argv),
        variant_configs=variant_configs(blocks),
        config={
            "model": MODEL,
            "labels": LABELS,
            "engine": ENGINE,
            "repeats": args.repeats,
            "quick": args.quick,
            "points": points,
            "headline_point": HEADLINE,
            "block_sizes_vllm_chose": blocks,
            "block_size_note": "block_size=16 asked; vLLM's hybrid align mode raised it",
            "drift_vs_fp32_truth": drift,
        },  # fmt: skip
        series=series,
        sweep_axis="questions_per_context",
        plot_metric="ratio_vs_best_vllm",
    )


if __name__ == "__main__":
    sys.exit(main())
