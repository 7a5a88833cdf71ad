"""LEAP vs the length predictors it claims to beat, on the same requests, in one run.

SmolLM2-135M-Instruct serves ShareGPT first turns through ``vllm serve`` with
``--max-num-seqs 4`` (so requests queue) at several Poisson rates. Labels are
SmolLM2's own greedy output lengths (cap ``--max-tokens``). Variants, all but
FCFS through the same LeapScheduler (only the source of predictions differs):

- ``fcfs``: vLLM's default scheduler;
- ``prompt_sf``: shortest prompt first (prompt tokens as the length hint);
- ``encoder``: MiniLM sentence embedding + linear head on the same calibration
  set (the separate-encoder class of S3/SSJF), predictions sent as hints;
- ``leap_static``: LEAP's probe + calibrated head, no online correction;
- ``leap``: LEAP with online RLS (default prior ``prompt_length``: requests not yet
  prefilled are admitted shortest prompt first) and its other defaults, loops
  included (a runner seen repeating a token cycle runs to its max_tokens);
- ``leap_no_loops``: ``leap`` with ``loops=off`` (results written before loops
  existed call this variant ``leap``);
- ``leap_fcfs_prior``: ablation, LEAP with prior ``fcfs`` (requests not yet prefilled
  are admitted in arrival order);
- ``leap_lane``: LEAP with a probe lane (``probe_slots=1``): one of the four slots
  prefills queued requests only to read their probe, so they are ordered by
  prediction before they take a decode slot;
- ``leap_margin0``: LEAP with ``preempt_margin=0``: any runner whose predicted
  remaining exceeds a waiting request's expected remaining (the prior, for one
  not prefilled yet) is parked for it, so a burst is probed by admission;
- ``leap_margin05``: LEAP with ``preempt_margin=0.5`` (the default before it became 0;
  results written before that change call this variant ``leap``);
- ``leap_refine`` / ``leap_refine_margin0``: ``leap`` / ``leap_margin0`` plus the
  decode-time refinement head (every ``--refine-every`` output tokens the probe
  layer's state re-predicts the remaining length; fitted on the same calibration
  prompts' recorded decode probes);
- ``leap_cond``: ``leap`` with ``remaining=conditional``: a runner's expected
  remaining is the mean of the head's log-normal error given the tokens it has
  generated (and its max_tokens), so one that outlived its prediction no longer
  looks about to finish (hints, so the baselines and the oracle, stay exact);
- ``leap_next_step``: ``leap`` with ``probe_delivery=next_step``, the default on
  CUDA (the probe vectors reach the scheduler a step late, copied without a
  sync): on CPU it costs no sync either way, so this measures only what the late
  predictions cost the schedule;
- ``oracle``: true lengths as hints (upper bound).

Every variant, plain vLLM included, is driven by vllm_ext's load generator rather
than ``vllm bench serve``, so that all get the very same requests, arrivals and
hints and every request's latency is kept.

Also: predictor quality (MAE in log space, Kendall tau) on the test prompts,
predictor CPU cost, and a drift replay (calibrated on ShareGPT, served
HumanEval + BFCL prompts) of the static head vs RLS.

Run: ``python -m benchmarks.leap`` (~15 min on 2 cores, most of it recording probe
vectors and greedy lengths, which later runs with the same inputs reuse from
``--record-cache``); ``--quick`` for a smoke run. The headline run and its exact
arguments are listed in ``benchmarks/suite.py`` (``make bench-leap``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.leap import drift, encoder
from benchmarks.leap.serve import (
    LOADER_NOTE,
    MAX_NUM_SEQS,
    METRIC,
    serve_all,
    variant_configs,
)
from vllm_ext.assets import model_path
from vllm_ext.bench import (
    OUT_DIR,
    BenchResult,
    collect_fingerprint,
    command_line,
    headline_from_rounds,
    headline_text,
    write_result,
)
from vllm_ext.leap.calibrate import load_prompts
from vllm_ext.leap.predictor import LinearLengthModel
from vllm_ext.leap.quality import summarize_predictions
from vllm_ext.leap.refine import fit_refine, refine_rows
from vllm_ext.leap.ridge_cv import choose_alpha

NAME = "leap_sharegpt"
BASELINES = ("fcfs", "prompt_sf", "encoder")
VARIANTS = (
    *BASELINES,
    "leap_static",
    "leap",
    "leap_fcfs_prior",
    "leap_lane",
    "leap_margin0",
    "leap_margin05",
    "leap_refine",
    "leap_refine_margin0",
    "leap_cond",
    "leap_no_loops",
    "leap_next_step",
    "oracle",
)
# the headline compares leap with the best baseline and with the oracle
REQUIRED = (*BASELINES, "leap", "oracle")
REFINED = ("leap_refine", "leap_refine_margin0")


def _record_in_subprocess(model: Path, prompts: list[str], args, out: Path) -> dict:
    """Probe vectors and greedy lengths of ``prompts`` from a real engine (own process)."""
    (out.parent / "prompts.json").write_text(json.dumps(prompts))
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.leap.record",
        str(model),
        str(out.parent / "prompts.json"),
        str(out),
        str(args.max_tokens),
        json.dumps(
            {"layer": args.layer, "pooling": args.pooling, "refine_every": args.refine_every}
        ),
        args.dtype,
    ]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    subprocess.run(cmd, check=True, env=env)
    with np.load(out) as data:
        return dict(data)


def _cached_record(model: Path, prompts: list[str], args, work: Path) -> dict:
    """:func:`_record_in_subprocess`, reusing an earlier recording of the same inputs."""
    cached = record_cache_path(model, prompts, args)
    if cached.exists():
        with np.load(cached) as data:
            return dict(data)
    rec = _record_in_subprocess(model, prompts, args, work / "record.npz")
    cached.parent.mkdir(parents=True, exist_ok=True)
    np.savez(cached, **rec)
    return rec


def record_cache_path(model: Path, prompts: list[str], args) -> Path:
    """Where the recording of these inputs is cached.

    Greedy outputs and probe vectors are a function of the model, the prompts,
    ``max_tokens`` and the probe settings, so those name the cache file.
    """
    key = [str(model), prompts, args.max_tokens, args.layer, args.pooling]
    key += [args.dtype, "decode probes every", args.refine_every, "output tokens"]
    key = json.dumps(key, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return Path(args.record_cache) / f"record-{digest}.npz"


def benchmark_prompts(args) -> tuple[list[str], list[str], list[str]]:
    """Calibration and test prompts (ShareGPT), and the drift mix (HumanEval + BFCL)."""
    cal = load_prompts("sharegpt", args.calibration, seed=0)
    test = load_prompts("sharegpt", args.requests, seed=0, offset=args.calibration)
    shift = load_prompts("humaneval", args.drift // 2, seed=0) + load_prompts(
        "bfcl", args.drift - args.drift // 2, seed=0
    )
    return cal, test, shift


def _prompt_tokens(model: Path, prompts: list[str]) -> np.ndarray:
    """Prompt lengths in tokens, chat template included (what the server prefills)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    texts = [
        tok.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
        )
        for p in prompts
    ]
    return np.asarray([len(tok(t, add_special_tokens=False)["input_ids"]) for t in texts], float)


def _predictor_cost(model: LinearLengthModel, X: np.ndarray, y: np.ndarray) -> dict:
    """CPU seconds per request of LEAP's head: one predict + one RLS update."""
    start = time.perf_counter()
    for x in X:
        model.predict(x)
    predict_s = (time.perf_counter() - start) / len(X)
    start = time.perf_counter()
    for x, length in zip(X, y, strict=True):
        model.rls_update(x, length, 0.999)
    return {"predict_s": predict_s, "rls_update_s": (time.perf_counter() - start) / len(X)}


def _variants(weights: Path, refine: Path, hints: dict[str, np.ndarray], args) -> dict[str, dict]:
    max_wait_s = args.max_wait_s
    # every variant but FCFS runs the LeapScheduler, so all share one aging bound
    aging = {"leap": {"max_wait_s": max_wait_s}}
    leap_static = {
        "leap": {"weights_path": str(weights), "online_rls": False, "max_wait_s": max_wait_s}
    }
    leap_online = {
        "leap": {"weights_path": str(weights), "online_rls": True, "max_wait_s": max_wait_s}
    }
    # ablation of the prior for requests not prefilled yet: arrival order
    leap_fcfs_prior = {"leap": {**leap_online["leap"], "prior": "fcfs"}}
    # the probe lane: one of the four slots probes queued requests before admission
    leap_lane = {"leap": {**leap_online["leap"], "probe_slots": 1}}
    # SRPT without the margin: a runner longer than the prior is parked for an unprobed request
    leap_margin0 = {"leap": {**leap_online["leap"], "preempt_margin": 0.0}}
    # the margin of the results before it became 0 by default
    leap_margin05 = {"leap": {**leap_online["leap"], "preempt_margin": 0.5}}
    refined = {"refine_weights_path": str(refine), "refine_every": args.refine_every}
    leap_refine = {"leap": {**leap_online["leap"], **refined}}
    leap_refine_margin0 = {"leap": {**leap_margin0["leap"], **refined}}
    # a runner's remaining is the head's log-normal error given what it generated
    leap_cond = {"leap": {**leap_online["leap"], "remaining": "conditional"}}
    # LEAP without reading its outputs for repetition loops (on by default)
    leap_no_loops = {"leap": {**leap_online["leap"], "loops": "off"}}
    # predictions a step late, as on CUDA by default
    leap_next_step = {"leap": {**leap_online["leap"], "probe_delivery": "next_step"}}
    return {
        "fcfs": {"launcher": "vllm", "args": []},
        "prompt_sf": {"plugins": True, "hints": hints["prompt_sf"], "config": aging},
        "encoder": {"plugins": True, "hints": hints["encoder"], "config": aging},
        "leap_static": {"plugins": True, "config": leap_static},
        "leap": {"plugins": True, "config": leap_online},
        "leap_fcfs_prior": {"plugins": True, "config": leap_fcfs_prior},
        "leap_lane": {"plugins": True, "config": leap_lane},
        "leap_margin0": {"plugins": True, "config": leap_margin0},
        "leap_margin05": {"plugins": True, "config": leap_margin05},
        "leap_refine": {"plugins": True, "config": leap_refine},
        "leap_refine_margin0": {"plugins": True, "config": leap_refine_margin0},
        "leap_cond": {"plugins": True, "config": leap_cond},
        "leap_no_loops": {"plugins": True, "config": leap_no_loops},
        "leap_next_step": {"plugins": True, "config": leap_next_step},
        "oracle": {"plugins": True, "hints": hints["oracle"], "config": aging},
    }


def _decode_rows(rec: dict, start: int, stop: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Decode probes of requests ``start..stop-1``: vectors, generated, request index - start."""
    rows = (rec["decode_request"] >= start) & (rec["decode_request"] < stop)
    return rec["decode_X"][rows], rec["decode_generated"][rows], rec["decode_request"][rows] - start


def _fit_refine(
    rec: dict, n_cal: int, n_test: int, leap_model, leap_alpha: float, out: Path
) -> dict:
    """Refinement head on the calibration probes; remaining-length quality on the test ones.

    Quality compares, at every recorded decode probe of a test request, the
    refined remaining length with what the prefill prediction alone implies
    (``max(predicted_total - generated, 1)``).
    """
    head, alpha = fit_refine(
        rec["X"][:n_cal], rec["y"][:n_cal], *_decode_rows(rec, 0, n_cal), prefill_alpha=leap_alpha
    )
    head.save(out)
    X_test, y_test = rec["X"][n_cal : n_cal + n_test], rec["y"][n_cal : n_cal + n_test]
    decode_X, generated, request = _decode_rows(rec, n_cal, n_cal + n_test)
    prefill = leap_model.predict_batch(X_test)
    features, remaining = refine_rows(decode_X, generated, request, prefill.log_mean, y_test)
    prefill_only = np.maximum(prefill.total_tokens[request] - generated, 1)
    return {
        "ridge_alpha": alpha,
        "decode_probes_calibration": int(np.sum(rec["decode_request"] < n_cal)),
        "decode_probes_test": int(len(generated)),
        "remaining_refined": summarize_predictions(
            head.predict_batch(features).total_tokens, remaining
        ),
        "remaining_prefill_only": summarize_predictions(prefill_only, remaining),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calibration", type=int, default=192)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--drift", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--rates", default="2,inf")
    parser.add_argument(
        "--max-wait-s",
        type=float,
        default=600.0,
        help="LEAP aging bound for every scheduler variant; above the run's length, so "
        "the ordering is measured, not aging (LEAP's default, 30 s, ages nearly every "
        "request of a burst on a slow CPU)",
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        help="vLLM --dtype of the served and recorded model (auto: the model's bf16; float32 "
        "decodes about 2x faster on CPUs without bf16 units)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="rounds over all variants (round-robin, fresh servers); medians are reported",
    )
    parser.add_argument(
        "--refine-every",
        type=int,
        default=32,
        help="output tokens between decode probes (recorded for, and used by, leap_refine)",
    )
    parser.add_argument("--layer", type=int, default=None)
    parser.add_argument("--pooling", default="last")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    parser.add_argument("--out", default=OUT_DIR)
    parser.add_argument(
        "--name",
        default=NAME,
        help="result name (file stem under --out); name runs with other settings apart",
    )
    parser.add_argument(
        "--variants",
        default=None,
        help="comma-separated subset of the variants (the baselines, leap and oracle "
        "always run: the headline needs them)",
    )
    parser.add_argument(
        "--record-cache",
        default="tmp/leap_record",
        help="folder for the recorded probe vectors and lengths (reused when the "
        "prompts and settings match; the recording is most of the run time)",
    )
    args = parser.parse_args(argv)
    chosen = set(VARIANTS)
    if args.variants:
        chosen = {*args.variants.split(","), *REQUIRED}
        unknown = sorted(chosen - set(VARIANTS))
        if unknown:
            parser.error(f"unknown variants {unknown}; choose from {VARIANTS}")
    if args.quick:
        args.calibration, args.requests, args.drift, args.max_tokens = 32, 8, 8, 32
    try:  # the encoder baseline always runs: fail now, not after the recording (~20 min)
        encoder.minilm_path()
    except ImportError as exc:
        parser.error(f"{exc} (or `make bench-deps`)")
    rates = sorted(float(r) for r in args.rates.split(","))
    model = model_path("smollm2")
    work = Path(tempfile.mkdtemp(prefix="bench-leap-"))

    cal, test, shift = benchmark_prompts(args)
    rec = _cached_record(model, cal + test + shift, args, work)
    n_cal, n_test = len(cal), len(test)
    X_cal, y_cal = rec["X"][:n_cal], rec["y"][:n_cal]
    X_test, y_test = rec["X"][n_cal : n_cal + n_test], rec["y"][n_cal : n_cal + n_test]
    X_drift, y_drift = rec["X"][n_cal + n_test :], rec["y"][n_cal + n_test :]

    # both heads: the same ridge fit with the penalty chosen by 4-fold CV on calibration data
    leap_alpha = choose_alpha(X_cal, y_cal)
    leap_model = LinearLengthModel.fit_ridge(X_cal, y_cal, alpha=leap_alpha)
    weights = work / "leap_weights.npz"
    leap_model.save(weights)
    E_cal, _ = encoder.embed(cal)
    E_test, encoder_s = encoder.embed(test)
    encoder_alpha = choose_alpha(E_cal, y_cal)
    enc_model = LinearLengthModel.fit_ridge(E_cal, y_cal, alpha=encoder_alpha)
    hints = {
        "prompt_sf": _prompt_tokens(model, test),
        "encoder": enc_model.predict_batch(E_test).total_tokens,
        "oracle": y_test,
    }
    quality = {
        "leap_static": summarize_predictions(leap_model.predict_batch(X_test).total_tokens, y_test),
        "encoder": summarize_predictions(hints["encoder"], y_test),
        "prompt_sf": summarize_predictions(hints["prompt_sf"], y_test),
    }
    cost = {
        **_predictor_cost(LinearLengthModel.load(weights), X_test, y_test),
        "encoder_s_per_request": encoder_s,
    }
    drift_result = drift.summarize(
        drift.replay(LinearLengthModel.load(weights), X_drift, y_drift, 0.999, 8192)
    )

    refine_weights = work / "leap_refine.npz"
    if _has_decode_probes(rec, n_cal, n_test):
        quality["leap_refine"] = _fit_refine(
            rec, n_cal, n_test, leap_model, leap_alpha, refine_weights
        )
    elif chosen & set(REFINED):
        parser.error(f"{sorted(chosen & set(REFINED))} need --max-tokens > --refine-every")
    variants = {
        k: v for k, v in _variants(weights, refine_weights, hints, args).items() if k in chosen
    }
    series, counters, power = serve_all(model, variants, test, rates, args, work)
    result = _result(args, rates, series, counters, power, quality, cost, drift_result)
    result.command = command_line("benchmarks.leap", argv)
    result.variant_configs = variant_configs(variants, args.dtype)
    write_result(result, args.out)
    h = result.headline
    sys.stdout.write(headline_text(h, "leap"))
    return 0


def _has_decode_probes(rec: dict, n_cal: int, n_test: int) -> bool:
    """Whether calibration and test requests both ran long enough to be probed while decoding."""
    requests = rec["decode_request"]
    test = (requests >= n_cal) & (requests < n_cal + n_test)
    return bool(np.any(requests < n_cal) and np.any(test))


def _result(args, rates, series, counters, power, quality, cost, drift_result) -> BenchResult:
    top = {name: dict(points[-1]) for name, points in series.items()}
    for name, metrics in top.items():
        metrics.update(
            {
                f"pred_{k}": v
                for k, v in quality.get(name, {}).items()
                if isinstance(v, (int, float))
            }
        )
    online = counters.get("leap", {})
    if online.get("leap_rls_updates_total"):
        top["leap"]["pred_online_mae_log"] = (
            online["leap_abs_log_error_sum_total"] / online["leap_rls_updates_total"]
        )
    best = min(BASELINES, key=lambda n: top[n][METRIC])
    # the head runs once per request (predict after prefill, RLS at finish);
    # compare it with the decode time the same request costs the engine
    per_request = cost["predict_s"] + cost["rls_update_s"]
    decode_s = top["leap"]["tpot_p50_s"] * top["leap"]["output_tokens_mean"]
    cost["leap_share_of_step_time"] = per_request / decode_s
    cost["encoder_share_of_step_time"] = cost["encoder_s_per_request"] / decode_s
    return BenchResult(
        name=args.name,
        description=f"{__doc__.split(chr(10) * 2)[0]} {LOADER_NOTE}",
        variants=top,
        headline=headline_from_rounds(
            METRIC,
            top["leap"][f"{METRIC}_runs"],
            top[best][f"{METRIC}_runs"],
            best,
            higher_is_better=False,
            target="ratio <= 0.75 vs best non-oracle baseline; within 15% "
            "of oracle; predictor < 1% of step time",
        ),
        fingerprint=collect_fingerprint(),
        power=power,
        series=series,
        sweep_axis="request_rate",
        plot_metric=METRIC,
        config={
            "model": "SmolLM2-135M-Instruct",
            "dtype": args.dtype,
            "max_num_seqs": MAX_NUM_SEQS,
            "rates": rates,
            "calibration_prompts": args.calibration,
            "test_requests": args.requests,
            "max_tokens": args.max_tokens,
            "max_wait_s": args.max_wait_s,
            "repeats": args.repeats,
            "quick": args.quick,
            "layer": args.layer,
            "pooling": args.pooling,
            "predictor_cost": cost,
            "predictor_quality": quality,
            "drift": drift_result,
            "counters": counters,
            "oracle_ratio_leap": top["leap"][METRIC] / top["oracle"][METRIC],
        },
    )


if __name__ == "__main__":
    sys.exit(main())
