"""Remaining-length refinement while decoding (TRAIL-style), on LEAP's linear head.

The prefill probe sees only the prompt; a request that turns out longer than
predicted keeps counting down towards "about to finish" and holds its decode
slot. Every ``refine_every`` output tokens the worker sends the probe layer's
state at the decoding token, and a second linear head re-predicts the
*remaining* output tokens from it:

``features = [h_decode (D), log1p(generated), prefill log-mean]`` [D+2]
``log1p(remaining) ~ LinearLengthModel(features)``

It is the same :class:`~vllm_ext.leap.predictor.LinearLengthModel` (ridge
calibration, RLS online correction, covariance-based uncertainty); only its
features and target differ. The prefill prediction is an input, so the head
learns how far to trust it as the output grows. Pure numpy (no vLLM).
"""

from __future__ import annotations

import math

import numpy as np

from vllm_ext.leap.predictor import LinearLengthModel, Prediction
from vllm_ext.leap.ridge_cv import choose_alpha, out_of_fold_log_mean

__all__ = [
    "fit_refine",
    "refine_features",
    "refine_rows",
    "refined_prediction",
]


def refine_features(vector, generated: int, prefill_log_mean: float) -> np.ndarray:
    """[D+2] refinement features of one decode probe.

    Args:
        vector: [D] probe-layer state at the decoding token.
        generated: output tokens known when it was computed (>= 1).
        prefill_log_mean: the prefill head's log1p(total) prediction.
    """
    vector = np.asarray(vector, dtype=np.float64).reshape(-1)
    return np.concatenate([vector, [math.log1p(generated), float(prefill_log_mean)]])


def refined_prediction(
    model: LinearLengthModel,
    features: np.ndarray,
    generated: int,
    max_len: int,
    with_std: bool = True,
) -> Prediction:
    """Total-length prediction ``generated + remaining`` from the refinement head.

    ``log_std`` is the head's uncertainty of log1p(remaining); the total is
    clamped to ``max_len`` like the prefill prediction.
    """
    features = np.asarray(features)[None, :]
    (prediction,) = refined_predictions(model, features, [generated], max_len, with_std)
    return prediction


def refined_predictions(
    model: LinearLengthModel, features: np.ndarray, generated, max_len: int, with_std: bool = True
) -> list[Prediction]:
    """:func:`refined_prediction` of [B, D+2] ``features`` in one batch."""
    remaining = model.predict_batch(features, max_len=max_len, with_std=with_std)
    out = []
    for i, done in enumerate(generated):
        row = remaining.row(i)
        total = min(done + row.total_tokens, float(max_len))
        out.append(Prediction(math.log1p(total), row.log_std, total))
    return out


def refine_rows(
    decode_X: np.ndarray,
    decode_generated: np.ndarray,
    decode_request: np.ndarray,
    prefill_log_mean: np.ndarray,
    lengths: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Features [M, D+2] and remaining lengths [M] of recorded decode probes.

    Args:
        decode_X: [M, D] decode probe vectors.
        decode_generated: [M] output tokens known at each probe.
        decode_request: [M] index of each probe's request into ``lengths``.
        prefill_log_mean: [N] the prefill head's prediction per request
            (out of fold on calibration data: an in-sample one would be
            overfit, and the head would learn to trust it too much).
        lengths: [N] true output lengths.
    """
    generated = np.asarray(decode_generated, dtype=np.float64)
    request = np.asarray(decode_request, dtype=np.int64)
    features = np.hstack(
        [
            np.asarray(decode_X, dtype=np.float64),
            np.log1p(generated)[:, None],
            np.asarray(prefill_log_mean, dtype=np.float64)[request][:, None],
        ]
    )
    remaining = np.maximum(np.asarray(lengths, dtype=np.float64)[request] - generated, 0.0)
    return features, remaining


def fit_refine(
    X: np.ndarray,
    y: np.ndarray,
    decode_X: np.ndarray,
    decode_generated: np.ndarray,
    decode_request: np.ndarray,
    *,
    prefill_alpha: float,
    init_scale: float = 1.0,
    seed: int = 0,
) -> tuple[LinearLengthModel, float]:
    """The refinement head for a recording, and its ridge penalty.

    Prefill predictions come out of fold (4 folds, ``prefill_alpha``); the
    penalty is chosen by cross-validation grouped by request, as one
    request's probes are strongly correlated.
    """
    log_mean = out_of_fold_log_mean(X, y, prefill_alpha, seed=seed)
    F, remaining = refine_rows(decode_X, decode_generated, decode_request, log_mean, y)
    alpha = choose_alpha(F, remaining, seed=seed, groups=decode_request)
    return LinearLengthModel.fit_ridge(F, remaining, alpha=alpha, init_scale=init_scale), alpha
