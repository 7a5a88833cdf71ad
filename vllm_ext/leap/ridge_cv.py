"""Cross-validation around LEAP's ridge fits: the penalty, and out-of-fold predictions.

Hidden states have hundreds of dimensions and calibration sets a few hundred
rows, so the penalty decides between fitting noise and fitting signal, and
in-sample predictions are far better than the head's real ones. Pure numpy.
"""

from __future__ import annotations

import numpy as np

from vllm_ext.leap.predictor import LinearLengthModel

RIDGE_ALPHAS = (0.1, 1.0, 10.0, 100.0, 1000.0)


def fold_parts(n: int, folds: int, seed: int, groups=None) -> list[np.ndarray]:
    """Row indices of ``folds`` parts; rows of one group (a request) share a part."""
    if groups is None:
        return np.array_split(np.random.default_rng(seed).permutation(n), folds)
    groups = np.asarray(groups)
    unique = np.random.default_rng(seed).permutation(np.unique(groups))
    return [np.flatnonzero(np.isin(groups, part)) for part in np.array_split(unique, folds)]


def choose_alpha(
    X: np.ndarray,
    y: np.ndarray,
    alphas=RIDGE_ALPHAS,
    folds: int = 4,
    seed: int = 0,
    groups=None,
) -> float:
    """The ridge penalty with the lowest k-fold MAE in log space.

    ``groups`` [N]: rows of one group are held out together (several decode
    probes of one request are nearly the same sample).
    """
    parts = fold_parts(len(y), folds, seed, groups)
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


def out_of_fold_log_mean(
    X: np.ndarray, y: np.ndarray, alpha: float, folds: int = 4, seed: int = 0
) -> np.ndarray:
    """[N] log1p-length predictions of a ridge head, each from the folds without its row."""
    out = np.empty(len(y), dtype=np.float64)
    for part in fold_parts(len(y), folds, seed):
        train = np.setdiff1d(np.arange(len(y)), part)
        model = LinearLengthModel.fit_ridge(X[train], y[train], alpha=alpha)
        out[part] = model.predict_batch(X[part]).log_mean
    return out
