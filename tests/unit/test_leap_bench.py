"""The LEAP benchmark's repeat rounds: medians per metric, every round's headline value kept."""

from __future__ import annotations

from benchmarks.leap.__main__ import METRIC, _median_point


def test_median_point_takes_numeric_medians_and_keeps_the_rounds():
    rounds = [
        {"request_rate": float("inf"), METRIC: 0.3, "count": 32, "label": "a"},
        {"request_rate": float("inf"), METRIC: 0.9, "count": 32, "label": "b"},
        {"request_rate": float("inf"), METRIC: 0.2, "count": 32, "label": "c"},
    ]
    point = _median_point(rounds)
    assert point[METRIC] == 0.3 and point["count"] == 32 and point["label"] == "a"
    assert point[f"{METRIC}_runs"] == [0.3, 0.9, 0.2]
    assert f"{METRIC}_runs" not in _median_point(rounds[:1])  # one round: nothing to list
