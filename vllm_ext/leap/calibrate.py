"""``python -m vllm_ext.leap.calibrate``: fit LEAP's linear head on the serving model.

Runs the serving model itself (a real vLLM engine with the LEAP probe) on a
prompt set, records the probe vector of every prompt and the number of tokens
the model then generated under the given sampling settings, fits ridge
regression on log(1 + length) and writes the weights file that
``weights_path`` points to. A held-out split reports the fit's quality.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

from vllm_ext.leap.config import LeapConfig
from vllm_ext.leap.predictor import LinearLengthModel
from vllm_ext.leap.quality import summarize_predictions

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
    """``vllm.LLM`` arguments that enable LEAP (probe loader, connector, scheduler)."""
    return dict(
        load_format="leap",
        scheduler_cls="vllm_ext.leap.scheduler.make_scheduler",
        kv_transfer_config={
            "kv_connector": "LeapConnector",
            "kv_role": "kv_both",
            "kv_connector_module_path": "vllm_ext.leap.connector",
        },
        additional_config={"leap": leap},
        enforce_eager=True,
        kv_cache_memory_bytes=kv_cache_bytes,
        max_model_len=4096,
        seed=0,
    )


def record(
    model: str,
    prompts: list[str],
    leap: dict,
    max_tokens: int,
    temperature: float,
    dtype: str = "auto",
) -> tuple[np.ndarray, np.ndarray]:
    """Probe vectors [N, D] and generated lengths [N] from one engine run (``dtype``: vLLM's)."""
    from vllm import LLM, SamplingParams

    leap = {**leap, "return_probe": True, "weights_path": None}
    llm = LLM(model=model, dtype=dtype, **engine_kwargs(leap))
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=0)
    outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    vectors, lengths = [], []
    for out in outputs:
        info = (out.kv_transfer_params or {}).get("leap") or {}
        if info.get("probe") is not None:
            vectors.append(info["probe"])
            lengths.append(len(out.outputs[0].token_ids))
    if not vectors:
        raise RuntimeError("no probe vectors came back; is the LEAP connector enabled?")
    return np.asarray(vectors, dtype=np.float64), np.asarray(lengths, dtype=np.float64)


RIDGE_ALPHAS = (0.1, 1.0, 10.0, 100.0, 1000.0)


def choose_alpha(
    X: np.ndarray, y: np.ndarray, alphas=RIDGE_ALPHAS, folds: int = 4, seed: int = 0
) -> float:
    """The ridge penalty with the lowest k-fold MAE in log space.

    Hidden states have hundreds of dimensions and calibration sets a few hundred
    rows, so the penalty decides between fitting noise and fitting signal.
    """
    parts = np.array_split(np.random.default_rng(seed).permutation(len(y)), folds)
    scores = []
    for alpha in alphas:
        errors = []
        for k in range(folds):
            train = np.concatenate([p for j, p in enumerate(parts) if j != k])
            model = LinearLengthModel.fit_ridge(X[train], y[train], alpha=alpha)
            pred = model.predict_batch(X[parts[k]]).total_tokens
            errors.append(np.abs(np.log1p(pred) - np.log1p(y[parts[k]])))
        scores.append(float(np.mean(np.concatenate(errors))))
    return float(alphas[int(np.argmin(scores))])


def fit(X: np.ndarray, y: np.ndarray, config: LeapConfig, holdout: float, seed: int):
    """Ridge on a train split, quality on the held-out split, then refit on all data."""
    order = np.random.default_rng(seed).permutation(len(y))
    n_test = int(len(y) * holdout)
    test, train = order[:n_test], order[n_test:]
    model = LinearLengthModel.fit_ridge(
        X[train], y[train], alpha=config.ridge_alpha, init_scale=config.rls_init_scale
    )
    quality = {}
    if n_test:
        pred = model.predict_batch(X[test], max_len=config.max_len).total_tokens
        quality = summarize_predictions(pred, y[test])
    final = LinearLengthModel.fit_ridge(
        X, y, alpha=config.ridge_alpha, init_scale=config.rls_init_scale
    )
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
    parser.add_argument("--ridge-alpha", type=float, default=1.0)
    parser.add_argument("--holdout", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    leap = {"layer": args.layer, "pooling": args.pooling, "ridge_alpha": args.ridge_alpha}
    config = LeapConfig(**leap)
    prompts = load_prompts(args.prompts, args.num_prompts, args.seed)
    X, y = record(args.model, prompts, leap, args.max_tokens, args.temperature)
    model, quality = fit(X, y, config, args.holdout, args.seed)
    model.save(args.out)
    report = {
        "prompts": args.prompts,
        "n": int(len(y)),
        "features": int(X.shape[1]),
        "layer": args.layer,
        "pooling": args.pooling,
        "max_tokens": args.max_tokens,
        "median_length": float(np.median(y)),
        "holdout": quality,
    }
    Path(args.out).with_suffix(".json").write_text(json.dumps(report, indent=2))
    sys.stdout.write(json.dumps(report) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
