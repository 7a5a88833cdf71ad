"""Quality of length predictions: error in log space and rank agreement.

A scheduler only needs the *order* of lengths right (Kendall's tau against
the true lengths, as in Learning-to-Rank) and errors in ratio rather than in
tokens (MAE of log1p: predicting 20 for 10 is as wrong as 2000 for 1000).
"""

from __future__ import annotations

import math

import numpy as np


def mae_log(pred_lengths, true_lengths) -> float:
    """Mean absolute error of log1p lengths.

    Args:
        pred_lengths: [N] predicted lengths (>= 0).
        true_lengths: [N] true lengths (>= 0).

    Returns:
        ``mean(|log1p(pred) - log1p(true)|)``.
    """
    pred, true = _pair(pred_lengths, true_lengths, nonnegative=True)
    return float(np.mean(np.abs(np.log1p(pred) - np.log1p(true))))


def kendall_tau(pred, true) -> float | None:
    """Kendall's tau-b between predicted and true values (ties handled).

    Args:
        pred: [N] predictions (any finite scores; only their order matters).
        true: [N] true values.

    Returns:
        tau in [-1, 1], or None where it is undefined (N < 2, or either
        side constant), never NaN.
    """
    pred, true = _pair(pred, true, nonnegative=False)
    if pred.size < 2 or np.all(pred == pred[0]) or np.all(true == true[0]):
        return None  # scipy would warn and return NaN here
    # imported here: scipy.stats costs ~0.5 s to import, the scheduler never needs it
    from scipy.stats import kendalltau

    tau = float(kendalltau(pred, true).statistic)
    return tau if math.isfinite(tau) else None


def summarize_predictions(pred, true) -> dict:
    """Summary of predicted vs true lengths.

    Args:
        pred: [N] predicted lengths (>= 0).
        true: [N] true lengths (>= 0).

    Returns:
        ``n``; ``mae_log``; ``kendall_tau`` (None if undefined); ``bias_log``
        (mean of log1p(pred) - log1p(true); > 0 means over-prediction);
        ``within_2x`` (fraction with (1 + pred) / (1 + true) in [1/2, 2]);
        ``mean_pred``; ``mean_true``.
    """
    pred, true = _pair(pred, true, nonnegative=True)
    log_err = np.log1p(pred) - np.log1p(true)
    return {
        "n": int(pred.size),
        "mae_log": float(np.mean(np.abs(log_err))),
        "kendall_tau": kendall_tau(pred, true),
        "bias_log": float(np.mean(log_err)),
        # small slack: a ratio of exactly 2 must count despite log rounding
        "within_2x": float(np.mean(np.abs(log_err) <= math.log(2) + 1e-12)),
        "mean_pred": float(np.mean(pred)),
        "mean_true": float(np.mean(true)),
    }


def _pair(a, b, nonnegative: bool) -> tuple[np.ndarray, np.ndarray]:
    """Validate two equally long, non-empty, finite 1-D arrays; returns them as float64."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.ndim != 1 or a.shape != b.shape or a.size == 0:
        raise ValueError(f"need two non-empty 1-D arrays of equal length, got {a.shape}, {b.shape}")
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        raise ValueError("lengths must be finite (drop requests without a prediction first)")
    if nonnegative and ((a < 0).any() or (b < 0).any()):
        raise ValueError("lengths must be >= 0")
    return a, b
