"""expected_remaining: the log-normal mean remaining, against sampling and the point rule."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_ext.leap.remaining import expected_remaining


def _sampled(total, generated, sigma, cap, n=400_000, seed=0):
    lengths = np.expm1(np.random.default_rng(seed).normal(np.log1p(total), sigma, n))
    alive = lengths > generated
    return float(np.mean(np.minimum(lengths[alive], cap) - generated))


@pytest.mark.parametrize(
    "total, generated, sigma, cap",
    [
        (100, 0, 0.6, np.inf),
        (100, 50, 0.6, np.inf),
        (100, 150, 0.6, np.inf),  # past the prediction
        (100, 400, 0.6, 512),  # far past it, near the cap
        (300, 100, 0.8, 512),
        (20, 5, 1.2, 64),
    ],
)
def test_equals_the_sampled_conditional_mean(total, generated, sigma, cap):
    got = float(expected_remaining(total, generated, sigma, cap))
    assert got == pytest.approx(_sampled(total, generated, sigma, cap), rel=0.02)


def test_zero_spread_is_the_point_rule_and_nan_stays_nan():
    total = np.array([100.0, 100.0, 100.0, np.nan, 600.0])
    generated = np.array([0.0, 60.0, 150.0, 3.0, 10.0])
    got = expected_remaining(total, generated, 0.0, np.array([np.inf] * 4 + [512.0]))
    np.testing.assert_array_equal(got[[0, 1, 2, 4]], [100.0, 40.0, 1.0, 502.0])
    assert np.isnan(got[3])
    assert np.isnan(expected_remaining(np.nan, 3, 0.5))
    assert expected_remaining(100.0, 0, 0.5).shape == ()  # scalars in, 0-d out


def test_a_request_past_its_prediction_no_longer_looks_about_to_finish():
    generated = np.array([0, 50, 100, 150, 300, 1_000, 10_000, 1e7])
    got = expected_remaining(100.0, generated, 0.6)
    assert np.all(np.isfinite(got)) and np.all(got >= 1)
    # the mean residual life of a log-normal falls, then rises past the median
    assert got[1] < got[0] and got[3] < got[4] < got[5] < got[6] < got[7]
    assert got[3] > 50  # the point rule says 1


def test_the_cap_bounds_the_remaining():
    generated = np.arange(0, 512, 7, dtype=np.float64)
    got = expected_remaining(400.0, generated, 1.0, 512)
    assert np.all(got <= 512 - generated) and np.all(got >= 1)
