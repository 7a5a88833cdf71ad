"""Expected remaining output tokens of a request that has not finished yet.

A point prediction says "T tokens in all"; after ``g`` tokens the plain
answer is ``max(T - g, 1)``: a request that outlived its prediction looks
about to finish and, under shortest-remaining-first, keeps its slot however
long it really is. The head's errors are roughly normal in log space
(it predicts ``log(1 + L)``), so the predictive length is log-normal with
median ``T`` and the head's residual spread ``sigma``. Conditioned on having
survived ``g`` tokens, and capped at the request's ``max_tokens`` ``c``::

    Y = log(1 + L) ~ N(mu, sigma^2),  mu = log(1 + T)
    E[min(1 + L, 1 + c) | L > g] =
        ( e^(mu + sigma^2/2) (Q(z1) - Q(w1)) + (1 + c) Q(w0) ) / Q(z0)

with ``Q`` the normal upper tail, ``z0 = (log(1 + g) - mu) / sigma``,
``z1 = z0 - sigma``, ``w0 = (log(1 + c) - mu) / sigma``, ``w1 = w0 - sigma``.
The remaining count is that minus ``1 + g``. It grows again once a request
passes its prediction (log-normal tails are heavy), and it is 0-spread
exact: ``sigma = 0`` gives the plain ``max(T - g, 1)``. Tail ratios are
taken in log space (``log_ndtr``), so a request far past its prediction
gives a finite answer. Pure numpy/scipy; no vLLM.
"""

from __future__ import annotations

import numpy as np
from scipy.special import log_ndtr


def expected_remaining(total, generated, sigma, cap=np.inf) -> np.ndarray:
    """Expected remaining tokens given ``generated`` so far (>= 1), elementwise.

    Args:
        total: predicted total output tokens (> 0; the log-normal's median).
        generated: output tokens generated so far (>= 0).
        sigma: std of the prediction's error in log1p space (>= 0; 0: exact).
        cap: the request's ``max_tokens`` (inf: none).

    Returns:
        float64 array of the broadcast shape. NaN where ``total`` is NaN.
    """
    arrays = np.broadcast_arrays(
        *(np.asarray(x, dtype=np.float64) for x in (total, generated, sigma, cap))
    )
    total, generated, sigma, cap = (np.ravel(x) for x in arrays)
    out = np.maximum(np.minimum(total, cap) - generated, 1.0)
    spread = sigma > 0
    if spread.any():
        out[spread] = _conditional(total[spread], generated[spread], sigma[spread], cap[spread])
    return out.reshape(arrays[0].shape)


def _conditional(total, generated, sigma, cap) -> np.ndarray:
    mu = np.log1p(total)
    a, b = np.log1p(generated), np.log1p(cap)  # b = inf: no cap
    z0 = (a - mu) / sigma
    w0 = (b - mu) / sigma
    log_q0 = log_ndtr(-z0)  # log P(L > g)
    with np.errstate(over="ignore", invalid="ignore"):
        scale = mu + sigma * sigma / 2 - log_q0
        body = np.exp(scale + log_ndtr(-(z0 - sigma))) - np.exp(scale + log_ndtr(-(w0 - sigma)))
        capped = np.where(np.isinf(b), 0.0, np.exp(b + log_ndtr(-w0) - log_q0))
        mean = body + capped  # E[min(1 + L, 1 + c) | L > g]
    # the conditional mean lies in (1 + g, 1 + c]; clamping absorbs rounding in the far tail
    mean = np.clip(np.nan_to_num(mean, nan=np.inf), a_min=np.exp(a), a_max=np.exp(b))
    remaining = np.maximum(mean - np.exp(a), 1.0)
    return np.where(np.isnan(total), np.nan, remaining)
