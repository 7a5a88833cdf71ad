"""``python -m vllm_ext.leap.calibrate``: fit LEAP's linear head on the serving model.

Runs the serving model itself (a real vLLM engine with the LEAP probe) on a
prompt set, records the probe vector of every prompt and the number of tokens
the model then generated under the given sampling settings, fits ridge
regression on log(1 + length) and writes the weights file that
``weights_path`` points to. A held-out split reports the fit's quality.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

from vllm_ext.common.config import config_block
from vllm_ext.leap.config import SYSTEM, LeapConfig
from vllm_ext.leap.predictor import LinearLengthModel
from vllm_ext.leap.quality import summarize_predictions
from vllm_ext.leap.refine import fit_refine

PROMPT_SETS = ("sharegpt", "humaneval", "bfcl")


def load_prompts(name: str, n: int, seed: int, offset: int = 0) -> list[str]:
    """``n`` user prompts from one of :data:`PROMPT_SETS` (``offset`` skips the first ones)."""
    if name == "sharegpt":
        from vllm_ext.datasets.sharegpt import first_turns

        return [s.prompt for s in first_turns(offset + n, seed=seed, max_prompt_chars=2000)][
            offset:
        ]
    if name == "humaneval":
        from vllm_ext.datasets.humaneval import load

        problems = load()
        return [f"Complete this Python function:\n{p.prompt}" for p in problems][
            offset : offset + n
        ]
    if name == "bfcl":
        from vllm_ext.datasets.bfcl import load_multi_turn

        turns = [
            t.turns[0][0]["content"] for t in load_multi_turn("base") if t.turns and t.turns[0]
        ]
        return turns[offset : offset + n]
    raise ValueError(f"unknown prompt set {name!r}; choose from {', '.join(PROMPT_SETS)}")


def engine_kwargs(leap: dict, *, kv_cache_bytes: int = 512 << 20) -> dict:
    """``vllm.LLM`` arguments that enable LEAP (probe loader, connector, scheduler).

    ``leap``: LeapConfig values by field name; experimental ones are nested under
    ``"experimental"`` here, as a user writes them in ``--additional-config``.
    """
    return dict(
        load_format="leap",
        scheduler_cls="vllm_ext.leap.scheduler.make_scheduler",
        kv_transfer_config={
            "kv_connector": "LeapConnector",
            "kv_role": "kv_both",
            "kv_connector_module_path": "vllm_ext.leap.connector",
        },
        additional_config={SYSTEM: config_block(LeapConfig, leap)},
        enforce_eager=True,
        kv_cache_memory_bytes=kv_cache_bytes,
        max_model_len=4096,
        seed=0,
    )


@dataclass(frozen=True)
class Recording:
    """What one calibration run saw: per request, and per decode probe.

    ``X`` [N, D] prefill probe vectors, ``y`` [N] generated lengths; with
    ``refine_every`` set, ``decode_X`` [M, D] decode probes taken after
    ``decode_generated`` [M] output tokens of request ``decode_request`` [M].
    ``tokens`` [N, max_tokens]: the generated ids, -1 past the end (where
    repetition loops begin, :mod:`~vllm_ext.leap.loops`).
    """

    X: np.ndarray
    y: np.ndarray
    decode_X: np.ndarray
    decode_generated: np.ndarray
    decode_request: np.ndarray
    tokens: np.ndarray

    def arrays(self) -> dict[str, np.ndarray]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def record(
    model: str,
    prompts: list[str],
    leap: dict,
    max_tokens: int,
    temperature: float,
    dtype: str = "auto",
) -> Recording:
    """Probe vectors and generated lengths from one engine run (``dtype``: vLLM's).

    ``leap["refine_every"]`` (default 32) also spaces the decode probes recorded
    for the refinement head.
    """
    from vllm import LLM, SamplingParams

    leap = {**leap, "return_probe": True, "weights_path": None}
    llm = LLM(model=model, dtype=dtype, **engine_kwargs(leap))
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=0)
    outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    vectors, lengths, decode, tokens = [], [], [], []
    for out in outputs:
        info = (out.kv_transfer_params or {}).get("leap") or {}
        if info.get("probe") is not None:
            decode += [(g, v, len(vectors)) for g, v in info.get("decode_probes") or ()]
            vectors.append(info["probe"])
            lengths.append(len(out.outputs[0].token_ids))
            tokens.append(out.outputs[0].token_ids)
    if not vectors:
        raise RuntimeError("no probe vectors came back; is the LEAP connector enabled?")
    dim = len(vectors[0])
    return Recording(
        X=np.asarray(vectors, dtype=np.float64),
        y=np.asarray(lengths, dtype=np.float64),
        decode_X=np.asarray([v for _, v, _ in decode], dtype=np.float64).reshape(-1, dim),
        decode_generated=np.asarray([g for g, _, _ in decode], dtype=np.float64),
        decode_request=np.asarray([r for _, _, r in decode], dtype=np.int64),
        tokens=padded_tokens(tokens, max_tokens),
    )


def padded_tokens(outputs: list, max_tokens: int) -> np.ndarray:
    """[N, max_tokens] generated token ids, -1 past each output's end."""
    table = np.full((len(outputs), max_tokens), -1, dtype=np.int64)
    for row, ids in zip(table, outputs, strict=True):
        row[: len(ids)] = ids
    return table


@dataclass(frozen=True)
class FitOptions:
    """Constants of the calibration fit (calibrate CLI options, not serving settings).

    ``ridge_alpha``: ridge penalty (>= 0); ``rls_init_scale``: scale of the RLS
    covariance stored with the weights, where online correction starts (> 0).
    """

    ridge_alpha: float = 1.0
    rls_init_scale: float = 1.0


def fit(X: np.ndarray, y: np.ndarray, config: LeapConfig, fit_options: FitOptions, holdout, seed):
    """Ridge on a train split, quality on the held-out split, then refit on all data."""
    order = np.random.default_rng(seed).permutation(len(y))
    n_test = int(len(y) * holdout)
    test, train = order[:n_test], order[n_test:]
    alpha, scale = fit_options.ridge_alpha, fit_options.rls_init_scale
    model = LinearLengthModel.fit_ridge(X[train], y[train], alpha=alpha, init_scale=scale)
    quality = {}
    if n_test:
        pred = model.predict_batch(X[test], max_len=config.max_len).total_tokens
        quality = summarize_predictions(pred, y[test])
    final = LinearLengthModel.fit_ridge(X, y, alpha=alpha, init_scale=scale)
    return final, quality


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vllm_ext.leap.calibrate", description=__doc__)
    parser.add_argument("--model", required=True, help="model path (e.g. the smollm2 asset)")
    parser.add_argument("--out", required=True, help="weights file to write (.npz)")
    parser.add_argument("--prompts", default="sharegpt", choices=PROMPT_SETS)
    parser.add_argument("--num-prompts", type=int, default=400)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--layer", type=int, default=None)
    parser.add_argument("--pooling", default="last", choices=("last", "mean"))
    parser.add_argument("--ridge-alpha", type=float, default=1.0, help="ridge penalty (>= 0)")
    parser.add_argument(
        "--rls-init-scale",
        type=float,
        default=1.0,
        help="scale of the RLS covariance saved with the weights, where online correction "
        "starts (> 0)",
    )
    parser.add_argument("--holdout", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--refine-every",
        type=int,
        default=0,
        help="also fit the decode-time refinement head on probes every N output tokens "
        "(serve it with refine_weights_path and the same refine_every); 0 = off",
    )
    parser.add_argument(
        "--refine-out", default=None, help="refinement weights (default: OUT stem + .refine.npz)"
    )
    args = parser.parse_args(argv)
    if args.refine_every < 0:
        parser.error(f"--refine-every must be >= 0, got {args.refine_every}")
    if not args.ridge_alpha >= 0:
        parser.error(f"--ridge-alpha must be >= 0, got {args.ridge_alpha}")
    if not 0 < args.rls_init_scale < float("inf"):
        parser.error(f"--rls-init-scale must be > 0, got {args.rls_init_scale}")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    leap = {"layer": args.layer, "pooling": args.pooling}
    if args.refine_every:
        leap["refine_every"] = args.refine_every
    config = LeapConfig(**leap)
    fit_options = FitOptions(args.ridge_alpha, args.rls_init_scale)
    prompts = load_prompts(args.prompts, args.num_prompts, args.seed)
    rec = record(args.model, prompts, leap, args.max_tokens, args.temperature)
    X, y = rec.X, rec.y
    model, quality = fit(X, y, config, fit_options, args.holdout, args.seed)
    model.save(args.out)
    report = {
        "prompts": args.prompts,
        "n": int(len(y)),
        "features": int(X.shape[1]),
        "layer": args.layer,
        "pooling": args.pooling,
        **dataclasses.asdict(fit_options),
        "max_tokens": args.max_tokens,
        "median_length": float(np.median(y)),
        "holdout": quality,
    }
    if args.refine_every:
        report["refine"] = _fit_and_save_refine(rec, fit_options, args)
    Path(args.out).with_suffix(".json").write_text(json.dumps(report, indent=2))
    sys.stdout.write(json.dumps(report) + "\n")
    return 0


def _fit_and_save_refine(rec: Recording, fit_options: FitOptions, args) -> dict:
    """Fit the refinement head on the recording's decode probes, write it, report it."""
    if len(rec.decode_generated) < 2:
        raise RuntimeError(
            f"only {len(rec.decode_generated)} decode probes were recorded; lower "
            "--refine-every or raise --max-tokens"
        )
    head, alpha = fit_refine(
        rec.X,
        rec.y,
        rec.decode_X,
        rec.decode_generated,
        rec.decode_request,
        prefill_alpha=fit_options.ridge_alpha,
        init_scale=fit_options.rls_init_scale,
        seed=args.seed,
    )
    out = args.refine_out or str(Path(args.out).with_suffix(".refine.npz"))
    head.save(out)
    return {
        "weights": out,
        "refine_every": args.refine_every,
        "decode_probes": int(len(rec.decode_generated)),
        "ridge_alpha": alpha,
    }


if __name__ == "__main__":
    sys.exit(main())
