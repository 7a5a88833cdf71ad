"""Decode-time refinement head and the ridge cross-validation helpers — without vLLM."""

from __future__ import annotations

import math

import numpy as np
import pytest

from vllm_ext.leap.predictor import LinearLengthModel
from vllm_ext.leap.quality import mae_log
from vllm_ext.leap.refine import fit_refine, refine_features, refine_rows, refined_prediction
from vllm_ext.leap.ridge_cv import fold_parts, out_of_fold_log_mean

DIM = 6


def test_refine_features_append_generated_and_the_prefill_prediction():
    features = refine_features([1.0] * DIM, 31, 4.5)
    assert features.shape == (DIM + 2,)
    assert features[-2] == pytest.approx(math.log(32)) and features[-1] == 4.5


def test_refine_rows_pair_each_probe_with_its_request_and_remaining_length():
    decode_X = np.arange(3 * DIM, dtype=float).reshape(3, DIM)
    F, remaining = refine_rows(decode_X, [32, 64, 32], [0, 0, 1], [3.0, 5.0], [70.0, 20.0])
    np.testing.assert_array_equal(remaining, [38.0, 6.0, 0.0])  # a probe past the end: 0
    np.testing.assert_array_equal(F[:, -1], [3.0, 3.0, 5.0])
    np.testing.assert_array_equal(F[:, :DIM], decode_X)


def test_refined_prediction_is_generated_plus_remaining_clamped(tmp_path):
    rng = np.random.default_rng(0)
    F = rng.normal(size=(50, DIM + 2))
    head = LinearLengthModel.fit_ridge(F, np.full(50, 99.0), alpha=1.0)  # remaining ~ 99
    prediction = refined_prediction(head, F[0], 40, max_len=8192)
    assert prediction.total_tokens == pytest.approx(139.0, rel=1e-3)
    assert prediction.log_mean == pytest.approx(math.log1p(prediction.total_tokens))
    assert refined_prediction(head, F[0], 40, max_len=100).total_tokens == 100


def _synthetic(n: int, seed: int):
    """Requests whose prompt hints at their length weakly; decode states say what is left."""
    rng = np.random.default_rng(seed)
    log_len = rng.uniform(2, 6, size=n)
    y = np.round(np.expm1(log_len))
    X = rng.normal(size=(n, DIM))
    X[:, 0] = log_len + rng.normal(scale=1.5, size=n)  # a noisy prompt-time signal
    rows = [(g, i) for i in range(n) for g in range(8, int(y[i]), 8)]
    generated = np.array([g for g, _ in rows], dtype=float)
    request = np.array([i for _, i in rows])
    decode_X = rng.normal(size=(len(rows), DIM))
    decode_X[:, 0] = np.log1p(y[request] - generated) + rng.normal(scale=0.2, size=len(rows))
    return X, y, decode_X, generated, request


def test_fitted_head_predicts_remaining_better_than_the_prefill_prediction_minus_generated():
    X, y, decode_X, generated, request = _synthetic(300, 0)
    head, alpha = fit_refine(X, y, decode_X, generated, request, prefill_alpha=1.0)
    assert alpha > 0
    Xt, yt, dXt, gt, rt = _synthetic(100, 1)
    prefill = LinearLengthModel.fit_ridge(X, y, alpha=1.0).predict_batch(Xt)
    F, remaining = refine_rows(dXt, gt, rt, prefill.log_mean, yt)
    refined = head.predict_batch(F).total_tokens
    prefill_only = np.maximum(prefill.total_tokens[rt] - gt, 1.0)
    assert mae_log(refined, remaining) < 0.5 * mae_log(prefill_only, remaining)


def test_groups_stay_in_one_fold_and_out_of_fold_predictions_ignore_their_own_label():
    groups = np.repeat(np.arange(20), 3)
    parts = fold_parts(len(groups), 4, seed=0, groups=groups)
    assert sorted(np.concatenate(parts).tolist()) == list(range(60))
    assert all(len({*groups[p]} & {*groups[q]}) == 0 for p in parts for q in parts if p is not q)
    rng = np.random.default_rng(0)
    X, y = rng.normal(size=(40, DIM)), rng.integers(5, 200, size=40).astype(float)
    before = out_of_fold_log_mean(X, y, alpha=1.0)
    y2 = y.copy()
    y2[7] = 5000.0
    assert out_of_fold_log_mean(X, y2, alpha=1.0)[7] == pytest.approx(before[7])
