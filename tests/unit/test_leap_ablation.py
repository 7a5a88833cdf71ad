"""The probe ablation's cross-validation: held out means held out."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.leap.ablation import cross_validated

pytestmark = pytest.mark.unit


def _lengths(seed: int = 0, n: int = 120, d: int = 6):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, d))
    y = np.expm1(3.0 + X @ rng.normal(size=d) * 0.5 + rng.normal(scale=0.1, size=n))
    return X, np.round(np.maximum(y, 1.0))


def test_a_row_prediction_does_not_see_its_own_label():
    X, y = _lengths()
    pred = cross_validated(X, y, folds=5)
    changed = y.copy()
    changed[7] *= 50  # a wild label moves its training folds' fits, not its own prediction
    assert cross_validated(X, changed, folds=5)[7] == pytest.approx(pred[7], rel=1e-12)
    assert not np.allclose(cross_validated(X, changed, folds=5), pred)


def test_informative_features_predict_held_out_lengths():
    X, y = _lengths()
    pred = cross_validated(X, y, folds=5)
    assert np.corrcoef(np.log1p(pred), np.log1p(y))[0, 1] > 0.9
    # features unrelated to the lengths predict about the mean, not the lengths
    noise = np.random.default_rng(1).normal(size=X.shape)
    assert abs(np.corrcoef(np.log1p(cross_validated(noise, y, 5)), np.log1p(y))[0, 1]) < 0.4
