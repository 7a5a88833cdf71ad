"""Drift: calibrated on ShareGPT, served a different mix; static head vs online RLS.

Replays the recorded (probe vector, true length) pairs of the new mix in
arrival order through the very model class the plugin runs
(:class:`LinearLengthModel`): the static head only predicts; the RLS head
predicts, then corrects itself with the true length, as LeapRuntime does when
a request finishes.
"""

from __future__ import annotations

import copy

import numpy as np

from vllm_ext.leap.predictor import LinearLengthModel


def replay(
    model: LinearLengthModel, X: np.ndarray, y: np.ndarray, forgetting: float, max_len: int
) -> dict:
    """Per-request |log error| of the static and the online-corrected head."""
    static, online = model, copy.deepcopy(model)
    err_static, err_online = [], []
    for x, length in zip(X, y, strict=True):
        target = np.log1p(length)
        err_static.append(abs(np.log1p(static.predict(x, max_len=max_len).total_tokens) - target))
        err_online.append(abs(np.log1p(online.predict(x, max_len=max_len).total_tokens) - target))
        online.rls_update(x, length, forgetting)
    return {"static": np.asarray(err_static), "rls": np.asarray(err_online)}


def summarize(errors: dict, windows: int = 4) -> dict:
    """MAE (log space) per consecutive window of the stream, per head."""
    out = {}
    for name, err in errors.items():
        chunks = np.array_split(err, windows)
        out[name] = {
            "mae_log": float(err.mean()),
            "mae_log_by_window": [float(c.mean()) for c in chunks],
        }
    return out
