"""LinearLengthModel: ridge calibration, prediction, RLS numerics, atomic persistence."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest

from vllm_ext.leap import predictor
from vllm_ext.leap.predictor import LinearLengthModel, PredictionError

# per-feature offsets and scales spanning six orders of magnitude, like raw hidden states
OFFSETS = np.array([0.0, 3.0, -50.0, 1e3, 0.01, 7.0])
SCALES = np.array([1e-3, 1.0, 10.0, 1e3, 0.1, 5.0])
TRUE_COEF = np.array([200.0, 0.3, -0.02, 4e-4, 2.0, 0.05])  # ~O(0.1..1) effect per feature
TRUE_BIAS = 4.0


def _data(rng, n, coef=TRUE_COEF, noise=0.05, bias=TRUE_BIAS):
    """Features [n, D], lengths [n] with log1p(length) = x @ coef + intercept + noise."""
    X = OFFSETS + SCALES * rng.normal(size=(n, OFFSETS.size))
    y = (X - OFFSETS) @ coef + bias + noise * rng.normal(size=n)
    assert y.min() > 0  # lengths >= 0 without clipping, so the truth is exactly linear
    return X, np.expm1(y), coef, bias - OFFSETS @ coef


def _state(model):
    return (model.w.copy(), model.P.copy(), model.noise_var, model.n_updates)


def _assert_same_state(model, state):
    w, P, noise_var, n_updates = state
    assert np.array_equal(model.w, w) and np.array_equal(model.P, P)
    assert model.noise_var == noise_var and model.n_updates == n_updates


def test_ridge_recovers_known_weights():
    X, lengths, coef, intercept = _data(np.random.default_rng(0), 4000)
    model = LinearLengthModel.fit_ridge(X, lengths, alpha=1e-3)
    got_coef, got_intercept = model.raw_weights()
    np.testing.assert_allclose(got_coef, coef, rtol=0.02)
    # the intercept absorbs offset * coef error (offsets up to 1e3)
    np.testing.assert_allclose(got_intercept, intercept, atol=0.02)
    assert model.noise_var == pytest.approx(0.05**2, rel=0.1)
    # features were standardised with the data's own statistics
    np.testing.assert_allclose(model.mean, X.mean(0))
    np.testing.assert_allclose(model.scale, X.std(0))
    model.check_invariants()


def test_calibration_noise_estimate_is_dof_corrected():
    """30 rows, 7 unknowns: RSS / N would be ~23/30 of the truth; RSS / (N - dof) is unbiased."""
    rng = np.random.default_rng(13)
    noise = 0.2
    estimates = [
        LinearLengthModel.fit_ridge(*_data(rng, 30, noise=noise)[:2], alpha=1e-6).noise_var
        for _ in range(200)
    ]
    assert np.mean(estimates) == pytest.approx(noise**2, rel=0.1)


def test_constant_feature_gets_unit_scale():
    rng = np.random.default_rng(1)
    X, lengths, _, _ = _data(rng, 200)
    X[:, 2] = 5.0
    model = LinearLengthModel.fit_ridge(X, lengths, alpha=1.0)
    assert model.scale[2] == 1.0 and model.w[2] == pytest.approx(0.0, abs=1e-12)


def test_rls_tracks_drift_and_beats_static_model():
    rng = np.random.default_rng(2)
    X0, lengths0, _, _ = _data(rng, 500)
    drifted = TRUE_COEF * np.array([-1.0, 1.5, 0.5, -1.0, 1.0, 2.0])
    X1, lengths1, coef1, intercept1 = _data(rng, 3000, coef=drifted, bias=6.0)
    static = LinearLengthModel.fit_ridge(X0, lengths0, alpha=1e-3)
    model = LinearLengthModel.fit_ridge(X0, lengths0, alpha=1e-3)
    errors = [model.rls_update(x, n, forgetting=0.99) for x, n in zip(X1, lengths1, strict=True)]
    assert None not in errors
    tail = slice(-500, None)
    rls_mae = np.mean(np.abs(errors[tail]))
    y_tail = np.log1p(lengths1[tail])
    static_mae = np.mean(np.abs(static.predict_batch(X1[tail]).log_mean - y_tail))
    assert rls_mae < 0.1 * static_mae and rls_mae < 2 * 0.05  # near the noise level
    got_coef, got_intercept = model.raw_weights()
    np.testing.assert_allclose(got_coef, coef1, rtol=0.1)
    np.testing.assert_allclose(got_intercept, intercept1, atol=0.1)
    model.check_invariants()


@pytest.mark.parametrize("init_scale", [1.0, 4.0])
def test_rls_without_forgetting_equals_ridge_refit(init_scale):
    rng = np.random.default_rng(3)
    X, lengths, _, _ = _data(rng, 140, noise=0.5)
    alpha, n0 = 0.5, 40
    model = LinearLengthModel.fit_ridge(X[:n0], lengths[:n0], alpha, init_scale)
    for x, n in zip(X[n0:], lengths[n0:], strict=True):
        assert model.rls_update(x, n, forgetting=1.0) is not None
    # closed form: ridge on all rows, calibration rows (and penalty) weighted 1 / init_scale
    phi = np.hstack([(X - model.mean) / model.scale, np.ones((len(X), 1))])
    weight = np.where(np.arange(len(X)) < n0, 1.0 / init_scale, 1.0)
    A = (phi * weight[:, None]).T @ phi + np.diag([alpha / init_scale] * 6 + [0.0])
    w_ref = np.linalg.solve(A, (phi * weight[:, None]).T @ np.log1p(lengths))
    P_ref = np.linalg.inv(A)
    p_tol = 1e-6 * np.abs(P_ref).max()  # P entries are ~1/N: an absolute 1e-6 would be loose
    np.testing.assert_allclose(model.w, w_ref, rtol=0, atol=1e-6)
    np.testing.assert_allclose(model.P, P_ref, rtol=0, atol=p_tol)
    if init_scale == 1.0:  # ... which is fit_ridge itself with the same standardisation
        ref = LinearLengthModel.fit_ridge(X, lengths, alpha, mean=model.mean, scale=model.scale)
        np.testing.assert_allclose(model.w, ref.w, rtol=0, atol=1e-6)
        np.testing.assert_allclose(model.P, ref.P, rtol=0, atol=p_tol)


def test_covariance_stays_symmetric_psd_and_capped_over_10k_updates():
    rng = np.random.default_rng(4)
    X, lengths, _, _ = _data(rng, 300)
    model = LinearLengthModel.fit_ridge(X, lengths, alpha=1.0)
    repeated = X[0] + 0.0
    for step in range(10_000):
        phase = (step // 2500) % 2  # diverse traffic, then one prompt repeated (wind-up)
        x = X[rng.integers(len(X))] if phase == 0 else repeated
        x = x * np.exp(rng.normal(scale=0.5)) if step % 7 == 0 else x  # outliers
        model.rls_update(x, float(rng.integers(0, 5000)), forgetting=0.95)
        if step % 500 == 499:
            model.check_invariants()  # includes bitwise symmetry and the trace cap
            eig = np.linalg.eigvalsh(model.P)
            assert eig.min() >= -1e-12 * eig.max()
    assert model.n_updates == 10_000
    assert model.n_capped > 0  # the repeated-prompt phases drove P into the cap
    assert np.trace(model.P) <= model.max_trace * (1 + 1e-9)


def test_blas_rank1_step_matches_numpy_and_keeps_p_symmetric_at_model_size(monkeypatch):
    # SmolLM2's 576 channels + bias; the BLAS path must be the one taken here
    rng = np.random.default_rng(6)
    dim = 576
    assert predictor._ger_keeps_symmetry(dim + 1)
    X = rng.normal(size=(800, dim)) * rng.uniform(0.1, 10, size=dim)
    lengths = rng.integers(1, 500, size=800).astype(float)
    blas_model = LinearLengthModel.fit_ridge(X[:700], lengths[:700])
    numpy_model = LinearLengthModel.fit_ridge(X[:700], lengths[:700])
    for x, n in zip(X[700:], lengths[700:], strict=True):
        blas_model.rls_update(x, n, forgetting=0.99)
    monkeypatch.setattr(predictor, "_ger_keeps_symmetry", lambda n: False)
    for x, n in zip(X[700:], lengths[700:], strict=True):
        numpy_model.rls_update(x, n, forgetting=0.99)
    blas_model.check_invariants()  # bitwise symmetric after 100 BLAS updates
    numpy_model.check_invariants()
    scale = np.abs(numpy_model.P).max()
    np.testing.assert_allclose(blas_model.P, numpy_model.P, rtol=0, atol=1e-12 * scale)
    np.testing.assert_allclose(blas_model.w, numpy_model.w, rtol=0, atol=1e-10)


def test_uncertainty_shrinks_as_updates_accumulate():
    rng = np.random.default_rng(5)
    X, lengths, _, _ = _data(rng, 2100, noise=0.3)
    model = LinearLengthModel.fit_ridge(X[:20], lengths[:20], alpha=1.0)
    probe = X[-1]
    stds = [model.predict(probe).log_std]
    for start, stop in [(20, 100), (100, 2000)]:
        for x, n in zip(X[start:stop], lengths[start:stop], strict=True):
            model.rls_update(x, n, forgetting=1.0)
        stds.append(model.predict(probe).log_std)
    assert stds[0] > stds[1] > stds[2] > 0 and stds[2] < stds[0] / 4


class _ListHandler(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.mark.parametrize(
    "feature, length",
    [(np.nan, 10.0), (np.inf, 10.0), (1e306, 10.0), (1.0, np.nan), (1.0, -1.0)],
    ids=["nan-feature", "inf-feature", "overflow", "nan-length", "negative-length"],
)
def test_bad_update_is_skipped_with_warning_and_state_unchanged(feature, length):
    X, lengths, _, _ = _data(np.random.default_rng(6), 100)
    model = LinearLengthModel.fit_ridge(X, lengths)
    before = _state(model)
    x = X[0].copy()
    x[3] = feature
    handler = _ListHandler()
    predictor.logger.addHandler(handler)
    try:
        assert model.rls_update(x, length, forgetting=0.99) is None
    finally:
        predictor.logger.removeHandler(handler)
    _assert_same_state(model, before)
    assert len(handler.messages) == 1 and "skipped" in handler.messages[0]
    assert model.rls_update(X[1], lengths[1], forgetting=0.99) is not None  # still usable


def test_non_finite_features_raise_prediction_error():
    X, lengths, _, _ = _data(np.random.default_rng(7), 100)
    model = LinearLengthModel.fit_ridge(X, lengths)
    before = _state(model)
    x = X[0].copy()
    x[1] = np.nan
    with pytest.raises(PredictionError):
        model.predict(x)
    batch = X[:5].copy()
    batch[3, 0] = np.inf
    with pytest.raises(PredictionError, match=r"rows \[3\]"):
        model.predict_batch(batch)
    _assert_same_state(model, before)
    assert issubclass(PredictionError, ValueError)
    with pytest.raises(ValueError, match="feature shape"):
        model.predict(X[0, :3])


def test_predict_matches_batch_and_clamps():
    X, lengths, _, _ = _data(np.random.default_rng(8), 300)
    model = LinearLengthModel.fit_ridge(X, lengths)
    batch = model.predict_batch(X[:10], max_len=100)
    for i in range(10):
        single = model.predict(X[i], max_len=100)
        assert single.log_mean == pytest.approx(batch.log_mean[i], rel=1e-12)
        assert single.log_std == pytest.approx(batch.log_std[i], rel=1e-12)
        assert single.total_tokens == pytest.approx(batch.total_tokens[i], rel=1e-12)
    expected = np.clip(np.expm1(batch.log_mean), 1, 100)
    np.testing.assert_allclose(batch.total_tokens, expected, rtol=1e-12)
    # without the uncertainty: the same means, no std
    lean = model.predict_batch(X[:10], max_len=100, with_std=False)
    assert lean.log_std is None and model.predict(X[0], with_std=False).log_std is None
    np.testing.assert_array_equal(lean.total_tokens, batch.total_tokens)
    with pytest.raises(PredictionError):
        model.predict_batch(np.full((2, X.shape[1]), np.nan), with_std=False)
    with np.errstate(all="raise"):  # no overflow on the way to the clamp
        far = model.predict(X[0] + 1e6 * model.scale * np.sign(model.w[:-1]), max_len=100)
    assert far.log_mean > 1000 and far.total_tokens == 100.0
    low = model.predict(X[0] - 1e3 * model.scale * np.sign(model.w[:-1]))
    assert low.total_tokens == 1.0


def test_fit_ridge_rejects_bad_input():
    X, lengths, _, _ = _data(np.random.default_rng(9), 5)
    with pytest.raises(ValueError, match="ridge_alpha=0"):
        LinearLengthModel.fit_ridge(X, lengths, alpha=0.0)  # 5 rows < 7 unknowns
    X[0, 0] = np.nan
    with pytest.raises(ValueError, match="finite"):
        LinearLengthModel.fit_ridge(X, lengths)
    with pytest.raises(ValueError, match="lengths"):
        LinearLengthModel.fit_ridge(X[1:], -lengths[1:])


def test_save_load_round_trip_is_exact(tmp_path):
    rng = np.random.default_rng(10)
    X, lengths, _, _ = _data(rng, 200)
    model = LinearLengthModel.fit_ridge(X[:100], lengths[:100], alpha=0.3, init_scale=2.0)
    for x, n in zip(X[100:], lengths[100:], strict=True):
        model.rls_update(x, n, forgetting=0.99)
    path = tmp_path / "leap.npz"
    model.save(path)
    model.save(path)  # overwriting is fine
    loaded = LinearLengthModel.load(path, dim=6)
    for name in ("w", "P", "mean", "scale"):
        assert np.array_equal(getattr(loaded, name), getattr(model, name)), name
    assert (loaded.noise_var, loaded.n_updates, loaded.max_trace) == (
        model.noise_var,
        model.n_updates,
        model.max_trace,
    )
    assert loaded.predict(X[0]) == model.predict(X[0])
    assert os.listdir(tmp_path) == ["leap.npz"]  # no temp file left behind


def test_load_checks_dimension_and_format(tmp_path):
    X, lengths, _, _ = _data(np.random.default_rng(11), 50)
    path = tmp_path / "w.npz"
    LinearLengthModel.fit_ridge(X, lengths).save(path)
    with pytest.raises(ValueError, match=r"feature dim 6, the model's is 576"):
        LinearLengthModel.load(path, dim=576)
    with np.load(path) as data:
        arrays = dict(data)
    np.savez(tmp_path / "v2.npz", **{**arrays, "format_version": 2})
    with pytest.raises(ValueError, match="format version 2"):
        LinearLengthModel.load(tmp_path / "v2.npz")
    np.savez(tmp_path / "asym.npz", **{**arrays, "P": arrays["P"] + np.triu(arrays["P"], 1)})
    LinearLengthModel.load(tmp_path / "asym.npz").check_invariants()  # symmetrised on load
    np.savez(tmp_path / "nan.npz", **{**arrays, "w": arrays["w"] * np.nan})
    with pytest.raises(ValueError, match="finite"):
        LinearLengthModel.load(tmp_path / "nan.npz")
    (tmp_path / "junk.npz").write_bytes(b"not a zip file")
    with pytest.raises(ValueError, match="not a LEAP weights file"):
        LinearLengthModel.load(tmp_path / "junk.npz")


def test_failed_save_keeps_the_old_file(tmp_path, monkeypatch):
    X, lengths, _, _ = _data(np.random.default_rng(12), 50)
    model = LinearLengthModel.fit_ridge(X, lengths)
    path = tmp_path / "w.npz"
    model.save(path)
    original = path.read_bytes()
    model.rls_update(X[0], 10_000.0, forgetting=0.9)

    def broken_fsync(fd):
        raise OSError("disk full")

    monkeypatch.setattr(predictor.os, "fsync", broken_fsync)
    with pytest.raises(OSError, match="disk full"):
        model.save(path)
    assert path.read_bytes() == original
    assert os.listdir(tmp_path) == ["w.npz"]


def test_one_blas_thread_limits_numpy_and_scipy_blas_only():
    from threadpoolctl import threadpool_info

    ours = predictor.use_one_blas_thread()
    assert ours  # numpy's and scipy's OpenBLAS are loaded here
    assert predictor.use_one_blas_thread() == ours  # once per process
    blas = {info["filepath"]: info["num_threads"] for info in threadpool_info()}
    assert all(blas[path] == 1 for path in ours)
    assert not predictor._ships_with_numpy_or_scipy("/site-packages/torch/lib/libopenblas.so")
    assert predictor._ships_with_numpy_or_scipy("/site-packages/scipy.libs/libscipy_openblas.so")
