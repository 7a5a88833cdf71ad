"""Linear length head on log(1 + output tokens): ridge calibration, RLS online correction.

Features ``x`` [D] (one layer's pooled prefill hidden state) are standardised
with the calibration mean/scale (raw hidden-state channels have wildly
different scales) and get a bias: ``phi = [(x - mean) / scale, 1]`` [D+1];
``log1p(output_tokens) ~ phi @ w``. ``P`` [D+1, D+1] is the RLS covariance and
``noise_var`` the residual variance, so ``phi P phi * noise_var`` is the
variance of the predicted log length. float64 throughout; ``P`` stays bitwise
symmetric; an update that would make the state non-finite is skipped whole.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import tempfile
import zipfile
from dataclasses import dataclass

import numpy as np
from scipy.linalg import blas

from vllm_ext.common.log import get_logger

logger = get_logger(__name__)

FORMAT_VERSION = 1
DEFAULT_MAX_LEN = 8192
# EW factor of the residual-variance estimate: ~100 recent requests
NOISE_DECAY = 0.99
_STATE = ("w", "P", "mean", "scale", "noise_var", "n_updates", "max_trace")


class PredictionError(ValueError):
    """Features or the resulting prediction are not finite."""


@dataclass(frozen=True)
class Prediction:
    """Predicted output length: log1p-space mean/std, and expm1(mean) clamped to [1, max_len].

    Floats from :meth:`~LinearLengthModel.predict`, [B] arrays from ``predict_batch``.
    ``log_std`` is None where it was not asked for (``with_std=False``).
    """

    log_mean: float
    log_std: float | None
    total_tokens: float

    def row(self, i: int) -> Prediction:
        """Row ``i`` of a ``predict_batch`` result, as floats."""
        std = None if self.log_std is None else float(self.log_std[i])
        return Prediction(float(self.log_mean[i]), std, float(self.total_tokens[i]))


class LinearLengthModel:
    """Linear head with RLS state. Construct with :meth:`fit_ridge` or :meth:`load`.

    Args:
        w: [D+1] weights on standardised features; last element is the bias.
        P: [D+1, D+1] symmetric PSD covariance.
        mean: [D] feature mean used for standardisation.
        scale: [D] positive feature scale used for standardisation.
        noise_var: residual variance estimate of log1p(length), >= 0.
        n_updates: RLS updates applied so far.
        max_trace: cap on trace(P); default ``max(D + 1, trace(P))``.
    """

    def __init__(self, w, P, mean, scale, noise_var, n_updates=0, max_trace=None):
        self.mean = np.array(mean, dtype=np.float64).reshape(-1)
        dim = self.mean.shape[0]
        self.scale = np.array(scale, dtype=np.float64).reshape(-1)
        self.w = np.array(w, dtype=np.float64).reshape(-1)
        P = np.array(P, dtype=np.float64)
        if self.scale.shape != (dim,) or self.w.shape != (dim + 1,) or P.shape != (dim + 1,) * 2:
            raise ValueError(
                f"inconsistent shapes: mean {self.mean.shape}, scale {self.scale.shape}, "
                f"w {self.w.shape}, P {P.shape} (expected [D], [D], [D+1], [D+1, D+1])"
            )
        # exact symmetry from the start; updates preserve it bitwise
        self.P = (P + P.T) * 0.5
        self.noise_var = float(noise_var)
        self.n_updates = int(n_updates)
        self.max_trace = float(max(dim + 1, np.trace(self.P)) if max_trace is None else max_trace)
        self.n_capped = 0  # updates where the trace cap bound; in memory only
        try:
            self.check_invariants()
        except AssertionError as exc:
            raise ValueError(str(exc)) from None

    @property
    def dim(self) -> int:
        """Feature dimension D."""
        return self.mean.shape[0]

    @property
    def num_features(self) -> int:
        """Alias of :attr:`dim`."""
        return self.dim

    @property
    def is_constant(self) -> bool:
        """True when every feature weight is 0: the same prediction for every request."""
        return not np.any(self.w[:-1])

    @classmethod
    def fit_ridge(
        cls, X, lengths, alpha: float = 1.0, init_scale: float = 1.0, *, mean=None, scale=None
    ) -> LinearLengthModel:
        """Closed-form ridge fit of log1p(lengths) on standardised X, bias unpenalised.

        With ``A = Phi^T Phi + alpha * diag(1, ..., 1, 0)``: ``w = A^-1 Phi^T y``
        and ``P = init_scale * A^-1``. That ``P`` is the exact RLS prior for
        this data: RLS with forgetting 1 started from (w, P) with
        ``init_scale = 1`` equals refitting ridge on all data seen so far;
        ``init_scale = s`` weighs the calibration data as 1/s samples each.
        ``noise_var`` = RSS / (N - effective dof), dof = trace of the hat matrix.

        Args:
            X: [N, D] features (N >= 2).
            lengths: [N] true output lengths (>= 0).
            alpha: ridge penalty on the standardised weights (>= 0).
            init_scale: scale of the initial covariance (> 0).
            mean, scale: optional fixed standardisation [D] (default: from X).

        Returns:
            The fitted model.
        """
        X, lengths = _as_matrix(X, "X"), np.asarray(lengths, dtype=np.float64).reshape(-1)
        n, dim = X.shape
        if n < 2 or lengths.shape != (n,):
            raise ValueError(
                f"fit_ridge: need N >= 2 and N lengths, got {X.shape}, {lengths.shape}"
            )
        if not (np.isfinite(X).all() and np.isfinite(lengths).all() and (lengths >= 0).all()):
            raise ValueError("fit_ridge: X and lengths must be finite and lengths >= 0")
        if not (alpha >= 0 and init_scale > 0):
            raise ValueError(f"fit_ridge: need alpha >= 0, init_scale > 0: {alpha}, {init_scale}")
        if mean is None:
            mean, std = X.mean(axis=0), X.std(axis=0)
            # constant channels stay 0 after centring; dividing by ~0 would amplify noise
            scale = np.where(std > 1e-12 * np.maximum(1.0, np.abs(mean)), std, 1.0)
        phi = np.hstack([(X - mean) / scale, np.ones((n, 1))])
        if alpha == 0 and np.linalg.matrix_rank(phi) < dim + 1:
            raise ValueError("ridge_alpha=0 needs full-rank features; use ridge_alpha > 0")
        gram = phi.T @ phi
        A = gram.copy()
        A[np.arange(dim), np.arange(dim)] += alpha
        y = np.log1p(lengths)
        w = np.linalg.solve(A, phi.T @ y)
        A_inv = np.linalg.solve(A, np.eye(dim + 1))
        A_inv = (A_inv + A_inv.T) * 0.5
        dof = float(np.sum(A_inv * gram))  # trace(A^-1 Phi^T Phi), both symmetric
        rss = float(np.sum((y - phi @ w) ** 2))
        noise_var = rss / max(n - dof, 1.0)
        P = init_scale * A_inv
        max_trace = max(init_scale * (dim + 1), float(np.trace(P)))
        return cls(w, P, mean, scale, noise_var, n_updates=0, max_trace=max_trace)

    def predict(self, x, max_len: int = DEFAULT_MAX_LEN, with_std: bool = True) -> Prediction:
        """Predict one request. ``x``: [D]. Raises PredictionError if not finite."""
        return self.predict_batch(self._vector(x)[None, :], max_len, with_std).row(0)

    def predict_batch(self, X, max_len: int = DEFAULT_MAX_LEN, with_std: bool = True) -> Prediction:
        """Vectorised :meth:`predict`.

        Args:
            X: [B, D] features.
            max_len: clamp for ``total_tokens`` (>= 1).
            with_std: also the uncertainty ``log_std``, ``sqrt(phi P phi * noise)``:
                O(B D^2), most of the cost (the mean is O(B D)); None without it.

        Returns:
            Prediction with fields of shape [B].

        Raises:
            PredictionError: a row is not finite (the message lists the rows).
        """
        X = _as_matrix(X, "X")
        if X.shape[1] != self.dim:
            raise ValueError(f"feature dim {X.shape[1]} != model dim {self.dim}")
        if not max_len >= 1:
            raise ValueError(f"max_len must be >= 1, got {max_len}")
        with np.errstate(over="ignore", invalid="ignore"):
            phi = self._phi(X)
            log_mean = phi @ self.w
            log_std = None
            if with_std:
                quad = np.sum((phi @ self.P) * phi, axis=1)
                log_std = np.sqrt(np.maximum(quad, 0.0) * self.noise_var)
        bad = ~(np.isfinite(phi).all(axis=1) & np.isfinite(log_mean))
        if log_std is not None:
            bad |= ~np.isfinite(log_std)
        if bad.any():
            rows = np.flatnonzero(bad).tolist()
            raise PredictionError(f"non-finite features or prediction in rows {rows[:16]}")
        # clamp in log space first: expm1 of a huge log_mean overflows to inf
        total = np.expm1(np.minimum(log_mean, np.log1p(max_len)))
        return Prediction(log_mean, log_std, np.clip(total, 1.0, max_len))

    def rls_update(
        self, x, true_length: float, forgetting: float, noise_decay: float = NOISE_DECAY
    ) -> float | None:
        """One exponentially weighted RLS step from a finished request.

        ``d = forgetting + phi P phi``, ``k = P phi / d``, ``w += k e``,
        ``P = (P - k phi^T P) / forgetting``. Trace cap: with forgetting < 1,
        directions the traffic never excites grow by 1/forgetting per update
        without bound (wind-up), so trace(P) is capped at ``max_trace`` (from
        :meth:`fit_ridge`: ``init_scale * (D + 1)``, i.e. on average no less
        certain per standardised direction than one unit-variance sample)
        by rescaling P. While the cap binds, excited directions stop forgetting
        too; it binds only under degenerate traffic (one prompt repeated) and
        bounds the gain when diverse traffic returns. ``noise_var`` is an EW
        average of ``e^2 * forgetting / d``: e^2 over its expected factor, as the
        a-priori error also carries the weight uncertainty reported in log_std.

        Args:
            x: [D] features of the finished request.
            true_length: its true output length (>= 0).
            forgetting: lambda in (0, 1]; 1 = no forgetting.
            noise_decay: EW factor of ``noise_var`` in [0, 1).

        Returns:
            The a-priori error ``log1p(true_length) - phi @ w`` (before the
            update), or None when the update was skipped (non-finite or negative
            input, or a numerically invalid step; a warning says why). A skipped
            update leaves the state untouched.
        """
        if not (0 < forgetting <= 1 and 0 <= noise_decay < 1):
            raise ValueError(
                f"need forgetting in (0, 1], noise_decay in [0, 1): {forgetting}, {noise_decay}"
            )
        x = self._vector(x)
        if not (np.isfinite(true_length) and true_length >= 0):
            return self._skip("true length %r is not a finite count", true_length)
        with np.errstate(over="ignore", invalid="ignore"):
            phi = self._phi(x[None, :])[0]
            p_phi = self.P @ phi
            denom = forgetting + float(phi @ p_phi)
            # np.float64, not float: a huge error must become inf (then skipped),
            # not raise OverflowError out of `err**2` below
            err = np.float64(np.log1p(true_length) - phi @ self.w)
        if not (np.isfinite(phi).all() and np.isfinite(p_phi).all() and np.isfinite(err)):
            return self._skip("non-finite features or error (e=%r)", err)
        if not (np.isfinite(denom) and denom > 0):
            return self._skip("non-positive RLS denominator %r", denom)
        with np.errstate(over="ignore", invalid="ignore"):
            w_new, P_new = _rls_step(self.w, self.P, p_phi, err, denom, forgetting)
            noise = noise_decay * self.noise_var + (1 - noise_decay) * err**2 * forgetting / denom
        if not (np.isfinite(w_new).all() and np.isfinite(P_new).all() and np.isfinite(noise)):
            return self._skip("update would make the state non-finite (e=%r)", err)
        trace = float(np.trace(P_new))
        if trace > self.max_trace:
            P_new *= self.max_trace / trace
            self.n_capped += 1
        self.w, self.P, self.noise_var = w_new, P_new, noise
        self.n_updates += 1
        return float(err)

    def raw_weights(self) -> tuple[np.ndarray, float]:
        """Weights on raw features: ``y ~ x @ coef + intercept``. Returns ([D], float)."""
        coef = self.w[:-1] / self.scale
        return coef, float(self.w[-1] - coef @ self.mean)

    def check_invariants(self) -> None:
        """Raise AssertionError naming what is inconsistent (finiteness, P, counters)."""
        P, arrays = self.P, (self.w, self.P, self.mean, self.scale)
        checks = (
            ("w/P/mean/scale finite", all(np.isfinite(a).all() for a in arrays)),
            ("scale > 0", (self.scale > 0).all()),
            ("0 <= noise_var < inf", 0 <= self.noise_var < np.inf),
            ("P symmetric", np.array_equal(P, P.T)),
            ("diag(P) >= 0", (np.diag(P) >= 0).all()),
            ("0 < trace(P) <= max_trace", 0 < np.trace(P) <= self.max_trace * (1 + 1e-9)),
            ("n_updates >= 0", self.n_updates >= 0),
        )
        failed = [name for name, ok in checks if not ok]
        if failed:
            raise AssertionError(f"LinearLengthModel invariants violated: {failed}")

    def save(self, path: str | os.PathLike) -> None:
        """Write the state to ``path`` (.npz) atomically: temp file, fsync, rename."""
        path = os.fspath(path)
        folder = os.path.dirname(os.path.abspath(path))
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=os.path.basename(path) + ".", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                state = {name: getattr(self, name) for name in _STATE}
                np.savez(f, format_version=FORMAT_VERSION, dim=self.dim, **state)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o644)  # mkstemp makes 0600; the file is not secret
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        fd = os.open(folder, os.O_RDONLY)  # fsync the folder: makes the rename durable
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    @classmethod
    def load(cls, path: str | os.PathLike, dim: int | None = None) -> LinearLengthModel:
        """Read a file written by :meth:`save`; ``dim``: expected feature dim D, if known."""
        path = os.fspath(path)
        try:
            with np.load(path, allow_pickle=False) as data:
                arrays = {key: data[key] for key in data.files}
        except (ValueError, EOFError, zipfile.BadZipFile) as exc:
            raise ValueError(f"{path}: not a LEAP weights file ({exc})") from exc
        missing = [key for key in ("format_version", "dim", *_STATE) if key not in arrays]
        if missing:
            raise ValueError(f"{path}: not a LEAP weights file (missing {missing})")
        version = int(arrays["format_version"])
        if version != FORMAT_VERSION:
            raise ValueError(f"{path}: format version {version}, this code reads {FORMAT_VERSION}")
        file_dim = int(arrays["dim"])
        if dim is not None and dim != file_dim:
            raise ValueError(f"{path}: weights have feature dim {file_dim}, the model's is {dim}")
        if arrays["mean"].shape != (file_dim,):
            raise ValueError(f"{path}: mean shape {arrays['mean'].shape} != dim {file_dim}")
        try:
            return cls(**{name: arrays[name] for name in _STATE})
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from exc

    def _phi(self, X: np.ndarray) -> np.ndarray:
        """[B, D] raw features -> [B, D+1] standardised features with a bias column."""
        return np.hstack([(X - self.mean) / self.scale, np.ones((X.shape[0], 1))])

    def _vector(self, x) -> np.ndarray:
        x = np.asarray(x, dtype=np.float64)
        if x.shape != (self.dim,):
            raise ValueError(f"feature shape {x.shape} != ({self.dim},)")
        return x

    def _skip(self, why: str, *args) -> None:
        logger.warning("LEAP RLS update skipped: " + why, *args)
        return None


def _rls_step(w, P, p_phi, err, denom, forgetting):
    """New (w [D+1], P [D+1, D+1]); the inputs are not modified.

    ``(P - p p^T / d) / lambda = P / lambda - q q^T`` with ``q = p / sqrt(d lambda)``:
    one scaled copy and one rank-1 BLAS update, about 4x faster than numpy's outer
    product and three passes over P (a pass over 577^2 doubles leaves the cache).
    """
    w_new = w + p_phi * (err / denom)
    q = p_phi * math.sqrt(1.0 / (denom * forgetting))
    P_new = P * (1.0 / forgetting)
    if _ger_keeps_symmetry(len(q)):
        # P_new is symmetric: its transpose is the Fortran-ordered matrix dger updates
        P_new = blas.dger(-1.0, q, q, a=P_new.T, overwrite_a=True).T
    else:
        P_new -= np.outer(q, q)  # q_i q_j == q_j q_i bitwise: stays symmetric
    return w_new, P_new


@functools.lru_cache(maxsize=8)
def _ger_keeps_symmetry(n: int) -> bool:
    """Whether this BLAS's ``dger(-1, q, q)`` keeps an [n, n] matrix bitwise symmetric.

    Entry (i, j) gets ``-q_j * q_i`` and (j, i) ``-q_i * q_j``: equal, unless the
    kernel rounds its vector body and its tail differently (fused vs separate
    multiply-add), which this one-off trial at the model's size would show.
    """
    rng = np.random.default_rng(0)
    A = rng.standard_normal((n, n))
    A = A + A.T
    q = rng.standard_normal(n)
    out = blas.dger(-1.0, q, q, a=A.T, overwrite_a=True).T
    same = bool(np.array_equal(out, out.T))
    if not same:
        logger.info("LEAP RLS: BLAS rank-1 update is not symmetric at dim %d; using numpy", n)
    return same


@functools.cache
def use_one_blas_thread() -> tuple[str, ...]:
    """Run numpy's and scipy's BLAS on one thread in this process; returns the libraries.

    LEAP's algebra is a few [577]-sized products per step: threads cannot help, and
    in an engine process on CPU the BLAS threads wait for cores that the model's
    OpenMP threads hold. There an RLS step took ~5 ms with two threads vs 0.75 ms
    with one. Other libraries' BLAS (torch's) are left alone. Idempotent.
    """
    from threadpoolctl import ThreadpoolController

    controller = ThreadpoolController()
    ours = tuple(
        info["filepath"]
        for info in controller.info()
        if info["user_api"] == "blas" and _ships_with_numpy_or_scipy(info["filepath"])
    )
    if ours:
        controller.select(filepath=list(ours)).limit(limits=1)
    return ours


def _ships_with_numpy_or_scipy(path: str) -> bool:
    parts = os.path.normpath(path).split(os.sep)
    return any(part.split(".")[0] in ("numpy", "scipy") for part in parts)


def _as_matrix(X, name: str) -> np.ndarray:
    X = np.asarray(X, dtype=np.float64)
    if X.ndim != 2:
        raise ValueError(f"{name} must be 2-D [N, D], got shape {X.shape}")
    return X
