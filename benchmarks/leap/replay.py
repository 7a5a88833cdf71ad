"""LEAP's scheduling rules replayed on recorded lengths: where the gap to the oracle comes from.

The served benchmark (``python -m benchmarks.leap``) runs one burst of 32
requests per round, ~20 min at 512 tokens on 2 cores, and its mean per-token
latency hangs on the burst's few shortest requests: one burst cannot tell
whether a gap to the oracle comes from the predictions or from the rules
that use them. This replays the rules on the same recording (greedy lengths,
probe vectors) in a token-step model of a ``--slots``-slot engine, seconds
per burst, with LEAP's own policy code deciding:

- each step every running request writes one token; a step takes ``step_s``
  plus ``prefill_s_per_token`` per token prefilled in it (an admitted
  request's prompt, and a resumed one's output too: its blocks are taken as
  evicted, the dearer case);
- a request's prediction exists after its first step (its prefill), as
  LEAP's probe does; the waiting order is :meth:`LeapPolicy.unaged_key`, and
  before each step :meth:`LeapPolicy.preemption_victims` parks runners for
  shorter waiting requests, a request not prefilled yet counting at the
  prior capped at its ``max_tokens`` (the scheduler's ``_leap_admit_shorter``);
- not modelled: HTTP and detokenisation, chunked-prefill budgets, batch-size
  dependent step times, aging (the served runs set it out of reach too).

Variants on the same bursts: ``fcfs``; ``oracle`` (true lengths known at
arrival); ``upfront`` (LEAP's predictions known at arrival, as a separate
encoder's are: the rules' cost of having to probe is ``leap`` / ``upfront``);
``leap``; ``leap_no_loops`` (LEAP without reading its outputs for repetition
loops: :mod:`vllm_ext.leap.loops`, on by default since it was measured
here); ``leap_cond`` (``remaining=conditional``); ``leap_cond_uncapped``
(the conditional rule with the prior it had before it was capped at each
request's max_tokens); ``leap_margin05``; ``leap_lane`` (``probe_slots=1``:
:meth:`LeapPolicy.plan_slots` each step, its picks admitted first). All but
``leap_no_loops``, ``fcfs`` and ``oracle`` see a request's loop when LEAP's
scheduler would (the recording keeps the generated tokens).

Bursts: the served benchmark's own 32 test requests, predicted by the head
fitted on its calibration prompts (the check against the served run), then
``--bursts`` random bursts of 32 out of all recorded calibration and test
prompts, each predicted out of fold (8-fold ridge, the served penalty). The
headline is the median over those bursts of ``leap`` / ``oracle``. A sweep
replaces the head's predictions by ``true * exp(N(0, s^2))``: what head
quality the rules need to come within 15 % of the oracle.

Run: ``python -m benchmarks.leap.replay`` (reuses the served benchmark's
recording from ``--record-cache``; ~5 min on one core).
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from scipy.stats import kendalltau
from tqdm import tqdm

from benchmarks.leap.__main__ import _cached_record, _prompt_tokens, benchmark_prompts
from vllm_ext.assets import model_path
from vllm_ext.bench import (
    OUT_DIR,
    BenchResult,
    collect_fingerprint,
    headline_from_rounds,
    write_result,
)
from vllm_ext.leap.config import LeapConfig
from vllm_ext.leap.loops import first_loop
from vllm_ext.leap.policy import LeapPolicy, RequestView
from vllm_ext.leap.predictor import LinearLengthModel
from vllm_ext.leap.ridge_cv import choose_alpha, out_of_fold_log_mean

NAME = "leap_replay"
METRIC = "ratio_to_oracle"
METRIC_S = "mean_per_token_latency_s"


@dataclass(frozen=True)
class Burst:
    """Requests arriving together: true and predicted output tokens, prompt tokens."""

    lengths: np.ndarray
    predicted: np.ndarray
    prompt_tokens: np.ndarray
    max_tokens: int
    # output tokens when the scheduler first sees each request repeat a cycle (inf: never)
    loop_onset: np.ndarray | None = None


@dataclass(frozen=True)
class Rules:
    """How a variant schedules (``fcfs``: vLLM's order, nothing parked)."""

    fcfs: bool = False
    known_upfront: bool = False  # predictions before prefill (oracle, separate encoder)
    exact: bool = False  # predictions are the truth: no error spread
    remaining: str = "point"
    preempt_margin: float = 0.0
    max_preemptions: int = 2
    capped_prior: bool = True
    probe_slots: int = 0  # the probe lane: LeapPolicy.plan_slots instead of the SRPT pairing
    loops: bool = False  # a request seen repeating a cycle runs to its cap (exact)


@dataclass(frozen=True)
class Engine:
    """The token-step model of the engine."""

    slots: int = 4
    step_s: float = 0.045  # the served runs' inter-token latency p50 (float32, 4 running)
    prefill_s_per_token: float = 2e-4


VARIANTS = {
    "fcfs": Rules(fcfs=True),
    "oracle": Rules(known_upfront=True, exact=True),
    # the served LEAP's defaults read the output for loops, so all of these do too
    "upfront": Rules(known_upfront=True, loops=True),
    "leap": Rules(loops=True),
    "leap_no_loops": Rules(),
    "leap_cond": Rules(remaining="conditional", loops=True),
    "leap_cond_uncapped": Rules(remaining="conditional", capped_prior=False, loops=True),
    "leap_margin05": Rules(preempt_margin=0.5, loops=True),
    "leap_lane": Rules(probe_slots=1, loops=True),
}


def replay(burst: Burst, rules: Rules, engine: Engine, typical: float, spread: float) -> dict:
    """Mean per-token latency (s) and parks of one burst under ``rules``.

    Args:
        typical: the prior's typical total length (the head's bias).
        spread: the head's error spread in log1p space (used by ``conditional``).
    """
    n = len(burst.lengths)
    policy = LeapPolicy(
        LeapConfig(
            preempt_margin=rules.preempt_margin,
            max_preemptions=rules.max_preemptions,
            remaining=rules.remaining,
        )
    )
    spread = 0.0 if rules.exact or rules.remaining == "point" else spread
    predicted = burst.lengths if rules.exact else burst.predicted
    known = np.full(n, rules.known_upfront)
    generated, parks_of = np.zeros(n, dtype=int), np.zeros(n, dtype=int)
    done_s = np.full(n, np.nan)
    seen = rules.loops and burst.loop_onset is not None
    onset = burst.loop_onset if seen else np.full(n, np.inf)

    def view(i: int, total=None, cap=burst.max_tokens) -> RequestView:
        error = spread
        if total is None and generated[i] >= onset[i]:
            total, error = float(cap), 0.0  # caught in a loop: it runs to its cap
        total = total if total is not None else (float(predicted[i]) if known[i] else None)
        args = (int(burst.prompt_tokens[i]), int(generated[i]), total, None, error, float(cap))
        return RequestView(str(i), i * 1e-6, *args)

    def expected(i: int) -> float:  # a waiting request's expected remaining
        if known[i]:
            return policy.remaining(view(i))
        return policy.remaining(
            view(i, typical, burst.max_tokens if rules.capped_prior else math.inf)
        )

    # a waiting request's key and expected remaining do not change while it waits
    waiting = {i: (i,) if rules.fcfs else policy.unaged_key(view(i)) for i in range(n)}
    waiting_expected = {i: expected(i) for i in range(n)}
    running: list[int] = []
    now, parks = 0.0, 0

    def movable(i: int) -> bool:  # the scheduler's _leap_movable, aging out of reach
        return bool(known[i] and generated[i] > 0 and parks_of[i] < rules.max_preemptions)

    while waiting or running:
        head: list[int] = []  # admitted first (the probe lane's plan), then the queue order
        if waiting and rules.probe_slots:
            plan = policy.plan_slots(
                [view(i) for i in waiting],
                [(view(i), movable(i)) for i in running],
                engine.slots,
                typical,
                min(rules.probe_slots, engine.slots - 1),
                now=0.0,
            )
            victims = [int(i) for i in plan.park]
            head = [int(i) for i in (*plan.admit, *plan.probe)]
        elif waiting and not rules.fcfs:
            runners = [(i, policy.remaining(view(i))) for i in running if known[i]]
            victims = policy.preemption_victims(
                waiting_expected.values(),
                runners,
                free_slots=engine.slots - len(running),
                margin=rules.preempt_margin,
                movable=movable,
            )
        else:
            victims = []
        for i in victims:
            running.remove(i)
            parks_of[i] += 1
            waiting[i], waiting_expected[i] = policy.unaged_key(view(i)), expected(i)
        parks += len(victims)
        rest = sorted((i for i in waiting if i not in head), key=waiting.get)
        admitted = [*head, *rest][: engine.slots - len(running)]
        for i in admitted:
            del waiting[i], waiting_expected[i]
        running += admitted
        prefilled = sum(int(burst.prompt_tokens[i] + generated[i]) for i in admitted)
        now += engine.step_s + engine.prefill_s_per_token * prefilled
        for i in list(running):
            generated[i] += 1
            known[i] = True  # the probe of its prefill
            if generated[i] >= burst.lengths[i]:
                done_s[i] = now
                running.remove(i)
    return {METRIC_S: float(np.mean(done_s / burst.lengths)), "parks": parks}


def loop_onsets(tokens: np.ndarray, config: LeapConfig) -> np.ndarray:
    """[N] output tokens when the scheduler first sees each recorded output repeat a
    cycle (``config``'s loop settings), inf where it never does. ``tokens``: [N, T], -1 padded."""
    onsets = []
    for row in tokens:
        ids = row[row >= 0].tolist()
        found = first_loop(
            ids, config.loop_max_period, config.loop_min_span, config.loop_check_every
        )
        onsets.append(math.inf if found is None else found)
    return np.asarray(onsets, dtype=float)


def loop_summary(onset: np.ndarray, lengths: np.ndarray, max_tokens: int) -> dict:
    """How many outputs ran to the cap, how many of them were seen looping and when,
    and the loops found in outputs that then stopped before it (false alarms)."""
    found, capped = np.isfinite(onset), lengths >= max_tokens
    hits = found & capped
    return {
        "outputs": int(len(lengths)),
        "capped": int(capped.sum()),
        "capped_found_looping": int(hits.sum()),
        "onset_median_tokens": float(np.median(onset[hits])) if hits.any() else None,
        "false_alarms": int((found & ~capped).sum()),
    }


def out_of_fold(X: np.ndarray, y: np.ndarray, alpha: float, folds: int = 8) -> np.ndarray:
    """[N] predicted totals of the ridge head, each from the folds without its row
    (at least 1, as the head's; the bursts' max_tokens caps them in the policy)."""
    return np.maximum(np.expm1(out_of_fold_log_mean(X, y, alpha, folds=folds)), 1.0)


def ratios(bursts: list[Burst], variants: dict, engine: Engine, typical, spread) -> dict:
    """Per variant: every burst's mean per-token latency over the oracle's, and its parks."""
    out = {name: {"ratios": [], "parks": []} for name in variants}
    for burst in tqdm(bursts, desc="bursts"):
        oracle = replay(burst, VARIANTS["oracle"], engine, typical, spread)
        for name, rules in variants.items():
            run = replay(burst, rules, engine, typical, spread)
            out[name]["ratios"].append(run[METRIC_S] / oracle[METRIC_S])
            out[name]["parks"].append(run["parks"])
    return out


def _summary(runs: dict) -> dict:
    r = np.asarray(runs["ratios"])
    return {
        METRIC: float(np.median(r)),
        "ratio_p10": float(np.percentile(r, 10)),
        "ratio_p90": float(np.percentile(r, 90)),
        "ratio_mean": float(np.mean(r)),
        "within_15pct_share": float(np.mean(r <= 1.15)),
        "parks_median": float(np.median(runs["parks"])),
    }


def quality_sweep(bursts, sigmas, engine, typical, seed: int = 0) -> list[dict]:
    """``upfront`` and ``leap`` with predictions ``true * exp(N(0, s^2))`` per ``s``."""
    rng = np.random.default_rng(seed)
    points = []
    for s in tqdm(sigmas, desc="quality sweep"):
        noisy = [
            replace(b, predicted=b.lengths * np.exp(rng.normal(0, s, len(b.lengths))))
            for b in bursts
        ]
        taus = [kendalltau(b.predicted, b.lengths)[0] for b in noisy]
        runs = ratios(noisy, {k: VARIANTS[k] for k in ("upfront", "leap")}, engine, typical, s)
        points.append(
            {
                "log_error_std": s,
                "kendall_tau_median": float(np.median(taus)),
                **{f"{k}_{METRIC}": float(np.median(v["ratios"])) for k, v in runs.items()},
            }
        )
    return points


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # the served benchmark's run whose recording is replayed (its cache key)
    parser.add_argument("--calibration", type=int, default=512)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--drift", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--record-cache", default="tmp/leap_record")
    parser.add_argument("--bursts", type=int, default=100)
    parser.add_argument("--sweep-bursts", type=int, default=30)
    parser.add_argument("--sigmas", default="0,0.25,0.5,0.75,1.0")
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--out", default=OUT_DIR)
    args = parser.parse_args(argv)
    recording = SimpleNamespace(layer=None, pooling="last", refine_every=32, **vars(args))
    model = model_path("smollm2")
    cal, test, shift = benchmark_prompts(recording)
    work = Path(tempfile.mkdtemp(prefix="bench-leap-replay-"))  # only if not cached
    rec = _cached_record(model, cal + test + shift, recording, work)
    n_cal, n = len(cal), len(cal) + len(test)
    X, y = rec["X"][:n], rec["y"][:n].astype(float)
    prompt_tokens = _prompt_tokens(model, cal + test)
    alpha = choose_alpha(X[:n_cal], y[:n_cal])
    head = LinearLengthModel.fit_ridge(X[:n_cal], y[:n_cal], alpha=alpha)
    typical, spread = float(np.expm1(head.w[-1])), float(np.sqrt(head.noise_var))
    engine = Engine(slots=args.slots)

    onset = loop_onsets(rec["tokens"][:n], LeapConfig())
    served = Burst(
        y[n_cal:],
        head.predict_batch(X[n_cal:]).total_tokens,
        prompt_tokens[n_cal:],
        args.max_tokens,
        onset[n_cal:],
    )
    served_runs = {
        name: replay(served, rules, engine, typical, spread) for name, rules in VARIANTS.items()
    }
    predicted = out_of_fold(X, y, alpha)
    rng = np.random.default_rng(0)
    picks = [rng.choice(n, args.requests, replace=False) for _ in range(args.bursts)]
    bursts = [Burst(y[p], predicted[p], prompt_tokens[p], args.max_tokens, onset[p]) for p in picks]
    runs = ratios(bursts, VARIANTS, engine, typical, spread)
    sigmas = [float(s) for s in args.sigmas.split(",")]
    sweep = quality_sweep(bursts[: args.sweep_bursts], sigmas, engine, typical)
    result = _result(args, engine, runs, served_runs, sweep, predicted, y, typical, spread)
    result.config["loops"] = loop_summary(onset, y, args.max_tokens)
    write_result(result, args.out)
    sys.stdout.write(f"{result.headline}\n")
    return 0


def _result(args, engine, runs, served_runs, sweep, predicted, y, typical, spread) -> BenchResult:
    variants = {}
    for name, r in runs.items():
        variants[name] = {
            **_summary(r),
            "served_burst_mean_per_token_latency_s": served_runs[name][METRIC_S],
            "served_burst_parks": served_runs[name]["parks"],
        }
    return BenchResult(
        name=NAME,
        description=__doc__.split("\n\n")[0],
        variants=variants,
        # deterministic given the recording: one round is the measurement
        headline=headline_from_rounds(
            METRIC,
            [variants["leap"][METRIC]],
            [variants["oracle"][METRIC]],
            "oracle",
            higher_is_better=False,
            target="within 15% of the oracle (the served benchmark's target), median over bursts",
        ),
        fingerprint=collect_fingerprint(),
        variant_configs={name: asdict(rules) for name, rules in VARIANTS.items()},
        plot_metric=METRIC,
        config={
            "engine": vars(engine),
            "bursts": args.bursts,
            "requests_per_burst": args.requests,
            "max_tokens": args.max_tokens,
            "calibration_prompts": args.calibration,
            "prior_typical_tokens": typical,
            "head_error_log_std": spread,
            "out_of_fold_kendall_tau": float(kendalltau(predicted, y)[0]),
            "quality_sweep": sweep,
        },
    )


if __name__ == "__main__":
    sys.exit(main())
