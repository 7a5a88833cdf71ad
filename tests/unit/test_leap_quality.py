"""Prediction-quality metrics against hand-computed values."""

from __future__ import annotations

import math

import numpy as np
import pytest

from vllm_ext.leap.quality import kendall_tau, mae_log, summarize_predictions


def test_mae_log_hand_computed():
    # log1p: [0, log 4] vs [log 2, log 2] -> both off by log 2
    assert mae_log([0, 3], [1, 1]) == pytest.approx(math.log(2), rel=1e-12)
    assert mae_log([5, 7], [5, 7]) == 0.0
    # symmetric in ratio: 2x over and 2x under (of 1 + length) cost the same
    assert mae_log([3], [1]) == pytest.approx(mae_log([1], [3]), rel=1e-12)


@pytest.mark.parametrize(
    "pred, true, tau",
    [
        ([1, 2, 3], [10, 20, 30], 1.0),
        ([3, 2, 1], [10, 20, 30], -1.0),
        ([1, 2, 3, 4], [1, 3, 2, 4], 2 / 3),  # 5 concordant, 1 discordant pair of 6
        ([1, 1, 2], [1, 2, 3], 2 / math.sqrt(6)),  # tau-b: C=2, D=0, one tie in pred
    ],
)
def test_kendall_tau_hand_computed(pred, true, tau):
    assert kendall_tau(pred, true) == pytest.approx(tau, rel=1e-12)


def test_kendall_tau_undefined_is_none_not_nan():
    assert kendall_tau([5], [7]) is None
    assert kendall_tau([4, 4, 4], [1, 2, 3]) is None
    assert kendall_tau([1, 2, 3], [9, 9, 9]) is None


def test_summarize_predictions_hand_computed():
    pred, true = [0, 3, 9, 30], [1, 1, 9, 9]
    # log1p errors: -log 2, +log 2, 0, log(31 / 10)
    summary = summarize_predictions(pred, true)
    assert summary["n"] == 4
    assert summary["mae_log"] == pytest.approx((2 * math.log(2) + math.log(3.1)) / 4, rel=1e-12)
    assert summary["bias_log"] == pytest.approx(math.log(3.1) / 4, rel=1e-12)
    assert summary["within_2x"] == 0.75  # ratios of exactly 1/2 and 2 count as within
    # tau-b: C=4, D=0, no ties in pred, two tied pairs in true -> 4 / sqrt(6 * 4)
    assert summary["kendall_tau"] == pytest.approx(4 / math.sqrt(24), rel=1e-12)
    assert (summary["mean_pred"], summary["mean_true"]) == (10.5, 5.0)
    assert summarize_predictions([3, 3], [1, 2])["kendall_tau"] is None


@pytest.mark.parametrize(
    "pred, true, needle",
    [
        ([1, 2], [1], "equal length"),
        ([], [], "non-empty"),
        ([1, np.nan], [1, 2], "finite"),
        ([1, 2], [1, np.inf], "finite"),
        ([-1, 2], [1, 2], ">= 0"),
    ],
)
def test_bad_input_is_a_clear_error(pred, true, needle):
    with pytest.raises(ValueError, match=needle):
        mae_log(pred, true)
    if needle != ">= 0":  # tau takes any finite scores
        with pytest.raises(ValueError, match=needle):
            kendall_tau(pred, true)
    else:
        assert kendall_tau(pred, true) == 1.0
