"""The heads study's scoring: LEAP's ridge held out per fold, best setting per family."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.leap.heads import METRIC, best_per_family, ridge_out_of_fold
from vllm_ext.leap.ridge_cv import fold_parts

pytestmark = pytest.mark.unit


def _lengths(seed: int = 0, n: int = 96, d: int = 5):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, d))
    y = np.expm1(3.0 + X @ rng.normal(size=d) * 0.5 + rng.normal(scale=0.1, size=n))
    return X, np.round(np.maximum(y, 1.0))


def test_ridge_rows_are_predicted_without_their_own_label():
    X, y = _lengths()
    parts = fold_parts(len(y), 4, seed=0)
    pred = ridge_out_of_fold(X, y, parts)
    changed = y.copy()
    changed[5] *= 40  # moves the other folds' fits (and maybe their penalty), not row 5's
    moved = ridge_out_of_fold(X, changed, parts)
    assert moved[5] == pytest.approx(pred[5], rel=1e-12)
    assert not np.allclose(moved, pred)
    assert np.corrcoef(np.log1p(pred), np.log1p(y))[0, 1] > 0.9


def test_best_per_family_picks_each_familys_highest_tau_and_skips_ridge():
    variants = {
        "ridge": {METRIC: 0.9},
        "knn[k=10]": {"family": "knn", METRIC: 0.2},
        "knn[k=30]": {"family": "knn", METRIC: 0.35},
        "knn[k=60]": {"family": "knn", METRIC: 0.3},
        "boosting[a]": {"family": "boosting", METRIC: 0.1},
    }
    assert best_per_family(variants) == {"knn": "knn[k=30]", "boosting": "boosting[a]"}
