"""LEAP probe ablation: predictor quality per probed layer and pooling, cross-validated.

The probe vector is one decoder layer's residual-stream output (``layer``)
pooled over the prompt (``pooling``: the last prompt token, or the mean). Every
setting is read from one transformers forward pass per prompt (a hook on each
decoder layer of the same SmolLM2 weights, in float32), on the LEAP benchmark's
ShareGPT prompts, and labelled with the benchmark's greedy output lengths (its
recording, reused from the cache). Quality: K-fold cross-validated MAE of
log(1 + length) and Kendall tau of the ridge head, the penalty chosen inside
each training fold as the benchmark does. The MiniLM encoder baseline's
features go through the same protocol, for reference.

Why not one vLLM engine run per setting: a prefill-only run of these prompts
takes ~10 min on 2 cores, a forward pass of all layers ~1 min. The engine's own
probe at the default setting (layer 15, last token) is recorded too and checked
against the transformers vectors (cosine similarity, and its quality is
reported beside theirs), so the grid measures what the engine would see.

Run: ``python -m benchmarks.leap.ablation`` (~12 min the first time, mostly the
engine check, then cached under ``--record-cache``).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from tqdm import tqdm

from benchmarks.leap import encoder
from benchmarks.leap.__main__ import _cached_record, benchmark_prompts
from vllm_ext.assets import model_path
from vllm_ext.bench import OUT_DIR, BenchResult, collect_fingerprint, make_headline, write_result
from vllm_ext.leap.predictor import LinearLengthModel
from vllm_ext.leap.quality import summarize_predictions
from vllm_ext.leap.ridge_cv import choose_alpha

NAME = "leap_probe_ablation"
METRIC = "kendall_tau"
DEFAULT_LAYER = 15  # LEAP's default: num_layers // 2 of SmolLM2's 30


def cross_validated(X: np.ndarray, y: np.ndarray, folds: int, seed: int = 0) -> np.ndarray:
    """Held-out predicted total tokens of every row: ridge fitted on the other folds."""
    order = np.random.default_rng(seed).permutation(len(y))
    pred = np.empty(len(y))
    for held in np.array_split(order, folds):
        train = np.setdiff1d(order, held)
        model = LinearLengthModel.fit_ridge(
            X[train], y[train], alpha=choose_alpha(X[train], y[train])
        )
        pred[held] = model.predict_batch(X[held]).total_tokens
    return pred


def layer_probes(model: Path, prompts: list[str]) -> dict[str, np.ndarray]:
    """Every decoder layer's probe of every prompt: ``{"last"|"mean": [N, layers, D]}``.

    A forward hook per layer reads its output (the residual stream, what LEAP's
    probe reads in vLLM) for the prompt rendered with the chat template, as the
    server renders it.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    # float32: bf16 matmuls are emulated (slow) on CPUs without bf16 units
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    layers = lm.model.layers
    outputs: list[torch.Tensor] = [None] * len(layers)

    def keep(index):
        def hook(_module, _args, output):
            outputs[index] = output[0] if isinstance(output, tuple) else output

        return hook

    handles = [layer.register_forward_hook(keep(i)) for i, layer in enumerate(layers)]
    last, mean = [], []
    try:
        with torch.no_grad():
            for prompt in tqdm(prompts, desc="layer probes"):
                text = tok.apply_chat_template(
                    [{"role": "user", "content": prompt}],
                    add_generation_prompt=True,
                    tokenize=False,
                )
                ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
                lm.model(input_ids=ids)
                states = torch.stack([o[0] for o in outputs]).float()  # [layers, T, D]
                last.append(states[:, -1].numpy())
                mean.append(states.mean(dim=1).numpy())
    finally:
        for handle in handles:
            handle.remove()
    return {"last": np.stack(last).astype(np.float64), "mean": np.stack(mean).astype(np.float64)}


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", default="1,3,5,7,9,11,13,15,17,19,21,23,25,27,29")
    parser.add_argument("--folds", type=int, default=8)
    # the LEAP benchmark's sizes: its greedy-length recording is reused from the cache
    parser.add_argument("--calibration", type=int, default=192)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--drift", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--record-cache", default="tmp/leap_record")
    parser.add_argument("--out", default=OUT_DIR)
    args = parser.parse_args(argv)
    model = model_path("smollm2")
    work = Path(tempfile.mkdtemp(prefix="bench-leap-ablation-"))
    cal, test, shift = benchmark_prompts(args)
    prompts = cal + test
    # the benchmark's recording settings (model dtype, default probe) name its cache file
    labels = SimpleNamespace(
        max_tokens=args.max_tokens,
        layer=None,
        pooling="last",
        dtype="auto",
        refine_every=32,
        record_cache=args.record_cache,
    )
    y = _cached_record(model, prompts + shift, labels, work)["y"][: len(prompts)]
    # the engine's own probe at the default setting, prefill only (max_tokens=1)
    engine = SimpleNamespace(
        max_tokens=1,
        layer=DEFAULT_LAYER,
        pooling="last",
        dtype="auto",
        refine_every=32,
        record_cache=args.record_cache,
    )
    X_engine = _cached_record(model, prompts, engine, work)["X"]

    probes = layer_probes(model, prompts)
    series: dict[str, list[dict]] = {}
    for pooling, X in probes.items():
        for layer in (int(v) for v in args.layers.split(",")):
            quality = summarize_predictions(cross_validated(X[:, layer], y, args.folds), y)
            series.setdefault(pooling, []).append({"layer": layer, **quality})
    # reference: the separate-encoder baseline's features under the same protocol
    E, _ = encoder.embed(prompts)
    reference = summarize_predictions(cross_validated(E, y, args.folds), y)
    check = {
        "engine_vs_transformers_cosine_min": float(
            _cosines(X_engine, probes["last"][:, DEFAULT_LAYER]).min()
        ),
        "engine_probe_quality": summarize_predictions(cross_validated(X_engine, y, args.folds), y),
    }
    result = _result(args, series, len(prompts), check, reference)
    write_result(result, args.out)
    sys.stdout.write(f"{result.headline}\n{check}\n")
    return 0


def _result(args, series, n: int, check: dict, reference: dict) -> BenchResult:
    variants = {
        f"{pooling}_L{point['layer']}": point
        for pooling, points in series.items()
        for point in points
    }
    default = variants[f"last_L{DEFAULT_LAYER}"]
    variants["minilm_encoder"] = {"layer": None, **reference}
    best_name = max(
        (k for k in variants if k != "minilm_encoder"), key=lambda k: variants[k][METRIC]
    )
    return BenchResult(
        name=NAME,
        description=__doc__.split("\n\n")[0],
        variants=variants,
        # the default setting (mid-depth layer 15 of 30, last token) vs the best one found
        headline=make_headline(
            METRIC,
            default[METRIC],
            variants[best_name][METRIC],
            best_name,
            higher_is_better=True,
            target="default probe setting within 10% of the best setting's tau",
        ),
        fingerprint=collect_fingerprint(),
        series=series,
        sweep_axis="layer",
        plot_metric=METRIC,
        config={
            "model": "SmolLM2-135M-Instruct, 30 decoder layers",
            # the grid's forward passes are float32; the engine check and the labels are bf16
            "grid_dtype": "float32",
            "prompts": n,
            "folds": args.folds,
            "label_max_tokens": args.max_tokens,
            "layers": [p["layer"] for p in next(iter(series.values()))],
            "poolings": list(series),
            "engine_check": check,
        },
    )


if __name__ == "__main__":
    sys.exit(main())
