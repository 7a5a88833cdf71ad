"""LeapRuntime: probe vectors in, predictions out, RLS on finish — without vLLM."""

from __future__ import annotations

import math

import numpy as np
import pytest

from vllm_ext.common.counters import Counters
from vllm_ext.leap.config import LeapConfig
from vllm_ext.leap.policy import LeapPolicy, RequestView
from vllm_ext.leap.predictor import LinearLengthModel
from vllm_ext.leap.runtime import COUNTERS, LeapRuntime

DIM = 8


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


@pytest.fixture
def weights(tmp_path):
    rng = np.random.default_rng(0)
    X = rng.normal(size=(200, DIM))
    y = np.expm1(3.0 + X[:, 0])  # length grows with feature 0
    path = tmp_path / "w.npz"
    LinearLengthModel.fit_ridge(X, y).save(path)
    return path


def _runtime(weights=None, clock=None, background_rls=False, **config):
    cfg = LeapConfig(weights_path=str(weights) if weights else None, **config)
    counters = Counters("leap", COUNTERS)
    return LeapRuntime(
        cfg, counters, clock=clock or Clock(), hidden_size=DIM, background_rls=background_rls
    )


def _vec(first: float) -> list[float]:
    return [first] + [0.0] * (DIM - 1)


def test_probe_vector_becomes_a_prediction_that_orders_by_length(weights):
    rt = _runtime(weights)
    rt.on_probe("short", _vec(-1.0))
    rt.on_probe("long", _vec(1.5))
    assert rt.prediction("short").total_tokens < rt.prediction("long").total_tokens
    assert rt.counters.value("predictions") == 2


def test_a_step_of_vectors_is_predicted_in_one_batch_as_one_by_one(weights):
    vectors = {f"r{i}": np.float32(_vec(i / 4 - 1)) for i in range(6)}
    batched, single = _runtime(weights, risk_k=1.0), _runtime(weights, risk_k=1.0)
    batched.on_probes(vectors)
    for req_id, vector in vectors.items():
        single.on_probe(req_id, vector)
    for req_id in vectors:
        a, b = batched.prediction(req_id), single.prediction(req_id)
        assert a.log_mean == pytest.approx(b.log_mean, abs=1e-12)
        assert a.log_std == pytest.approx(b.log_std, abs=1e-12)
    assert batched.counters.value("predictions") == 6


def test_a_bad_vector_in_a_batch_fails_only_its_own_request(weights):
    rt = _runtime(weights)
    rt.on_probes({"good": _vec(0.5), "nan": [float("nan")] * DIM, "other": _vec(-0.5)})
    assert rt.prediction("good") is not None and rt.prediction("other") is not None
    assert rt.prediction("nan") is None
    assert rt.counters.value("predictions") == 2
    assert rt.counters.value("fallbacks") == 1


def test_no_model_means_no_predictions_but_features_are_kept_for_calibration(tmp_path):
    rt = _runtime(return_probe=True)
    rt.on_probe("r", _vec(0.5))
    assert rt.prediction("r") is None and not rt.active
    info = rt.on_finished("r", 10, stopped=True, length_capped=False)
    assert info["probe"] == _vec(0.5) and info["predicted_tokens"] is None


def test_client_hint_outranks_the_probe_even_after_the_vector_arrives(weights):
    rt = _runtime(weights)
    assert rt.prediction("r", hint=40).total_tokens == 40
    rt.on_probe("r", _vec(1.5))
    assert rt.prediction("r").total_tokens == 40
    assert rt.counters.value("predictions") == 1


@pytest.mark.parametrize("hint", ["many", -3, 0, float("nan")])
def test_bad_hint_is_a_counted_fallback(weights, hint):
    rt = _runtime(weights)
    assert rt.prediction("r", hint=hint) is None
    assert rt.counters.value("fallbacks") == 1


def test_missing_vector_times_out_to_a_fallback_once(weights):
    clock = Clock()
    rt = _runtime(weights, clock=clock, prediction_timeout_s=1.0)
    rt.on_scheduled_prefill_done("r")
    clock.now = 0.5
    assert rt.prediction("r") is None and rt.counters.value("fallbacks") == 0
    clock.now = 2.0
    assert rt.prediction("r") is None and rt.prediction("r") is None
    assert rt.counters.value("fallbacks") == 1


def test_uncertainty_is_computed_only_where_the_order_uses_it(weights):
    # log_std costs O(D^2) per prediction; only risk_k > 0 reads it
    plain, risky = _runtime(weights), _runtime(weights, risk_k=0.5)
    for rt in (plain, risky):
        rt.on_probes({"a": _vec(0.5), "b": _vec(-0.5)})
    assert plain.prediction("a").log_std is None
    assert risky.prediction("a").log_std > 0
    assert plain.prediction("a").total_tokens == risky.prediction("a").total_tokens


def test_changed_predictions_and_distinct_totals_are_tracked_for_the_scheduler(
    weights, refine_weights
):
    # the scheduler re-keys a queued request only when take_changed names it
    clock = Clock()
    rt = _runtime(weights, clock=clock, refine_weights_path=str(refine_weights))
    rt.prediction("h1", hint=40)
    rt.prediction("h2", hint=40)
    assert rt.take_changed() == {"h1", "h2"} and rt.take_changed() == set()
    assert rt.distinct_predictions == 1  # equal hints: nothing to order by
    rt.on_probes({"p": _vec(1.0), "q": _vec(-1.0)})
    assert rt.take_changed() == {"p", "q"} and rt.distinct_predictions == 3
    rt.on_decode_probe("p", 5, _vec(0.5))  # a refinement is a change
    assert rt.take_changed() == {"p"}
    rt.on_scheduled_prefill_done("t")
    clock.now = 5.0
    assert rt.prediction("t") is None  # the timeout: it had no prediction, so no change
    assert rt.prediction("bad", hint="many") is None and rt.prediction("bad", hint="many") is None
    assert rt.take_changed() == set()  # nor is a bad hint, asked every step
    rt.on_probe("x", _vec(0.0))
    for req_id in ("h1", "h2", "p", "q", "t", "bad"):
        rt.on_finished(req_id, 10, stopped=True, length_capped=False)
    assert rt.distinct_predictions == 1  # only x is left
    assert rt.take_changed() == {"x"}
    rt.on_finished("x", 10, stopped=True, length_capped=False)
    assert rt.distinct_predictions == 0 and rt.take_changed() == set()


def test_rls_learns_from_stopped_and_under_predicted_capped_requests_only(weights):
    rt = _runtime(weights)
    for rid in ("stopped", "capped_low", "capped_high", "aborted"):
        rt.on_probe(rid, _vec(0.0))
    predicted = rt.prediction("stopped").total_tokens
    rt.on_finished("stopped", 30, stopped=True, length_capped=False)
    rt.on_finished("capped_low", int(predicted) + 50, stopped=False, length_capped=True)
    rt.on_finished("capped_high", max(1, int(predicted) - 5), stopped=False, length_capped=True)
    rt.on_finished("aborted", 3, stopped=False, length_capped=False)
    assert rt.counters.value("rls_updates") == 2
    assert rt.counters.value("rls_skipped") == 2
    assert rt.num_live() == 0


@pytest.mark.parametrize("drain_each", [True, False], ids=["in_step", "lagging"])
def test_background_rls_learns_what_inline_rls_learns(
    weights, refine_weights, tmp_path, drain_each
):
    runtimes = {
        background: _runtime(
            weights,
            background_rls=background,
            refine_weights_path=str(refine_weights),
            checkpoint_path=str(tmp_path / f"ck{background}.npz"),
            checkpoint_every=3,
        )
        for background in (False, True)
    }
    rng = np.random.default_rng(5)
    for i in range(10):
        vector, decode = _vec(rng.normal()), _decode_vec(rng.normal())
        for rt in runtimes.values():
            rt.on_probe(f"r{i}", vector)
            rt.on_decode_probe(f"r{i}", 32, decode)
            rt.on_finished(f"r{i}", 40 + 20 * i, stopped=True, length_capped=False)
            if drain_each:
                rt.drain()
    runtimes[True].drain()
    inline, background = runtimes[False], runtimes[True]
    # the same updates in the same order: bitwise the same main head. The refinement
    # features carry the prefill prediction, which a lagging worker may not have
    # corrected yet: its head then equals inline only when each update lands in-step
    heads = ("model", "refine") if drain_each else ("model",)
    for head in heads:
        a, b = getattr(inline, head), getattr(background, head)
        assert np.array_equal(a.w, b.w) and np.array_equal(a.P, b.P), head
    for name in ("rls_updates", "refine_rls_updates", "checkpoints"):
        assert inline.counters.value(name) == background.counters.value(name) > 0, name
    assert (tmp_path / "ckTrue.npz").exists()
    background.close()  # idempotent with the updates applied: nothing left in flight
    assert background.counters.value("rls_updates") == inline.counters.value("rls_updates")


def test_checkpoint_is_written_and_wins_over_weights_on_restart(weights, tmp_path):
    ckpt = tmp_path / "ckpt.npz"
    rt = _runtime(weights, checkpoint_path=str(ckpt), checkpoint_every=2)
    for i in range(4):
        rt.on_probe(f"r{i}", _vec(0.1 * i))
        rt.on_finished(f"r{i}", 50, stopped=True, length_capped=False)
    assert rt.counters.value("checkpoints") == 2
    restarted = _runtime(weights, checkpoint_path=str(ckpt))
    assert restarted.model.n_updates == 4
    np.testing.assert_array_equal(restarted.model.w, rt.model.w)


def test_typical_tokens_comes_from_the_bias_or_from_finished_lengths(weights):
    assert _runtime(weights).typical_tokens == pytest.approx(np.expm1(3.0), rel=0.1)
    rt = _runtime()
    assert rt.typical_tokens is None
    for i, n in enumerate((10, 1000)):
        rt.on_finished(f"r{i}", n, stopped=True, length_capped=False)
    assert rt.typical_tokens == pytest.approx(np.expm1((np.log1p(10) + np.log1p(1000)) / 2))


def test_conditional_remaining_takes_the_heads_residual_spread_unless_told(weights):
    assert _runtime(weights).error_log_std == 0.0  # remaining=point: predictions are exact
    assert _runtime(remaining="conditional").error_log_std == 0.0  # no head, no spread
    rt = _runtime(weights, remaining="conditional")
    assert rt.error_log_std == pytest.approx(np.sqrt(rt.model.noise_var)) and rt.error_log_std > 0
    told = _runtime(weights, remaining="conditional", error_log_std=0.7)
    assert told.error_log_std == 0.7
    # the prior is then a mean in the same units as runners: exp(sigma^2 / 2) above the median
    median = _runtime(weights).typical_tokens
    assert told.typical_tokens == median  # the typical total itself does not change
    expected = (1 + median) * np.exp(0.7**2 / 2) - 1  # (conditioned on L > 0: a hair more)
    assert told.prior_remaining([math.inf])[0] == pytest.approx(expected, rel=1e-3)


@pytest.mark.parametrize("remaining", ["point", "conditional"])
def test_the_prior_of_an_unprobed_request_is_capped_at_its_max_tokens(weights, remaining):
    rt = _runtime(weights, remaining=remaining)
    assert _runtime().prior_remaining([10.0]) is None  # nothing known yet
    caps = [1.0, 5.0, 20.0, 40.0, 400.0, 4000.0, math.inf]
    prior = rt.prior_remaining(caps)
    assert list(prior) == sorted(prior) and prior[0] == 1.0 and prior[-1] > 15  # typical ~ 19
    assert (prior <= np.asarray(caps)).all()  # never more than it may write
    # exactly how the policy scores a request predicted at the typical length
    policy = LeapPolicy(rt.config)
    for cap, value in zip(caps, prior, strict=True):
        view = RequestView("u", 0.0, 3, 0, rt.typical_tokens, None, rt.error_log_std, cap)
        assert value == pytest.approx(policy.remaining(view), rel=1e-12)


def test_informative_only_with_a_model_that_tells_requests_apart(weights, tmp_path):
    assert _runtime(weights).informative
    assert not _runtime().informative
    model = LinearLengthModel.load(weights)
    model.w[:-1] = 0.0
    model.save(tmp_path / "constant.npz")
    rt = _runtime(tmp_path / "constant.npz")
    assert rt.active and not rt.informative
    # online RLS turns a constant start into a model that tells requests apart
    for i, (x, n) in enumerate(((-1.0, 5), (1.0, 300), (-0.5, 10), (0.8, 200))):
        rt.on_probe(f"r{i}", _vec(x))
        rt.on_finished(f"r{i}", n, stopped=True, length_capped=False)
    assert rt.informative


@pytest.fixture
def refine_weights(tmp_path):
    """Refinement head: remaining length grows with feature 1 of the decode state."""
    rng = np.random.default_rng(1)
    F = rng.normal(size=(300, DIM + 2))
    path = tmp_path / "refine.npz"
    LinearLengthModel.fit_ridge(F, np.expm1(4.0 + F[:, 1])).save(path)
    return path


def _decode_vec(second: float) -> list[float]:
    return [0.0, second] + [0.0] * (DIM - 2)


def test_decode_probe_refines_to_generated_plus_predicted_remaining(weights, refine_weights):
    rt = _runtime(weights, refine_weights_path=str(refine_weights))
    rt.on_probe("r", _vec(0.0))
    prefill = rt.prediction("r").total_tokens
    rt.on_decode_probe("r", 32, _decode_vec(1.0))
    refined = rt.prediction("r").total_tokens
    assert refined > 32 + np.expm1(4.5) and refined != prefill
    assert rt.counters.value("refinements") == 1
    # a preempted request's prompt recompute re-sends its prefill probe: the refinement stays
    rt.on_probe("r", _vec(0.0))
    assert rt.prediction("r").total_tokens == refined
    info = rt.on_finished("r", 400, stopped=True, length_capped=False)
    assert info["predicted_tokens"] == pytest.approx(prefill)  # the prefill head's, reported
    assert rt.counters.value("refine_rls_updates") == 1


def test_a_step_of_decode_probes_is_refined_in_one_batch_as_one_by_one(weights, refine_weights):
    probes = {f"r{i}": (32 * (i + 1), _decode_vec(i / 3 - 1)) for i in range(5)}
    config = {"refine_weights_path": str(refine_weights), "risk_k": 1.0}  # uncertainty too
    batched, single = (_runtime(weights, **config) for _ in "ab")
    for rt in (batched, single):
        for req_id in [*probes, "bad"]:
            rt.on_probe(req_id, _vec(0.25))
    batched.on_decode_probes({**probes, "gone": (32, _decode_vec(0.0))})
    for req_id, (generated, vector) in probes.items():
        single.on_decode_probe(req_id, generated, vector)
    for req_id in probes:
        a, b = batched.prediction(req_id), single.prediction(req_id)
        assert a.total_tokens == pytest.approx(b.total_tokens, rel=1e-12)
        assert a.log_std == pytest.approx(b.log_std, abs=1e-12)
    assert batched.counters.value("refinements") == 5
    assert batched.num_live() == 6  # "gone" (aborted) left no entry
    # a NaN probe fails the batch: each request is then refined alone, the NaN one not
    before = batched.prediction("bad")
    batched.on_decode_probes({"bad": (64, [float("nan")] * DIM), "r0": (64, _decode_vec(0.5))})
    assert batched.counters.value("refinements") == 6
    assert batched.prediction("bad") == before


def test_hinted_and_unprobed_requests_are_not_refined(weights, refine_weights):
    rt = _runtime(weights, refine_weights_path=str(refine_weights))
    assert rt.prediction("hinted", hint=40).total_tokens == 40
    rt.on_probe("hinted", _vec(0.0))
    rt.on_decode_probe("hinted", 32, _decode_vec(2.0))
    rt.on_decode_probe("gone", 32, _decode_vec(2.0))  # aborted: no entry, nothing created
    assert rt.prediction("hinted").total_tokens == 40
    assert rt.counters.value("refinements") == 0 and rt.num_live() == 1


def test_a_loop_predicts_the_cap_exactly_and_outranks_later_probes(weights, refine_weights):
    rt = _runtime(weights, refine_weights_path=str(refine_weights), remaining="conditional")
    rt.on_probe("r", _vec(-1.0))
    prefill = rt.prediction("r")
    assert rt.watches_loops("r") and not rt.is_exact("r")
    rt.take_changed()
    rt.on_loop("r", 300)
    looped = rt.prediction("r")
    assert (looped.total_tokens, looped.log_std) == (300.0, 0.0)
    assert rt.is_exact("r") and not rt.watches_loops("r")
    assert rt.take_changed() == {"r"} and rt.counters.value("loops") == 1
    # neither a refinement nor the prefill probe re-sent after a preemption undoes it
    rt.on_decode_probe("r", 64, _decode_vec(-2.0))
    rt.on_probe("r", _vec(-1.0))
    rt.on_loop("r", 500)  # found again: nothing changes, nothing counted
    assert rt.prediction("r") == looped and rt.counters.value("loops") == 1
    # the true length teaches the prefill head, and the client sees its prediction
    info = rt.on_finished("r", 300, stopped=False, length_capped=True)
    assert info["predicted_tokens"] == pytest.approx(prefill.total_tokens)
    assert rt.counters.value("rls_updates") == 1


def test_hinted_unknown_and_clamped_loops(weights):
    rt = _runtime(weights, max_len=100)
    assert rt.prediction("hinted", hint=40).total_tokens == 40
    rt.on_loop("hinted", 300)  # the client's length stands
    rt.on_loop("gone", 300)  # finished or never probed: no entry is created
    assert not rt.watches_loops("hinted") and not rt.watches_loops("gone")
    assert rt.prediction("hinted").total_tokens == 40 and rt.num_live() == 1
    rt.on_probe("r", _vec(0.0))
    rt.on_loop("r", 300)
    assert rt.prediction("r").total_tokens == 100  # clamped at max_len like any prediction
    assert rt.counters.value("loops") == 1


def test_a_failed_refinement_keeps_the_prediction_and_serves_on(weights, refine_weights, caplog):
    rt = _runtime(weights, refine_weights_path=str(refine_weights))
    rt.on_probe("r", _vec(0.5))
    before = rt.prediction("r")
    rt.on_decode_probe("r", 32, [float("nan")] * DIM)
    rt.on_decode_probe("r", 64, [1.0] * (DIM + 3))  # wrong length
    assert rt.prediction("r") == before
    assert rt.counters.value("refinements") == 0 and rt.counters.value("fallbacks") == 0


def test_refinement_rls_follows_the_censoring_rule(weights, refine_weights):
    rt = _runtime(weights, refine_weights_path=str(refine_weights))
    for rid in ("capped_low", "capped_high"):
        rt.on_probe(rid, _vec(0.0))
    rt.on_decode_probe("capped_low", 32, _decode_vec(-2.0))  # predicts little left
    rt.on_decode_probe("capped_high", 32, _decode_vec(2.0))  # predicts a lot left
    cap = 80
    low, high = (rt.prediction(r).total_tokens for r in ("capped_low", "capped_high"))
    assert low < cap < high
    rt.on_finished("capped_low", cap, stopped=False, length_capped=True)
    rt.on_finished("capped_high", cap, stopped=False, length_capped=True)
    assert rt.counters.value("refine_rls_updates") == 1


def test_return_probe_returns_the_decode_probes_too():
    rt = _runtime(return_probe=True)
    rt.on_probe("r", _vec(0.5))
    rt.on_decode_probe("r", 32, _decode_vec(1.0))
    rt.on_decode_probe("r", 64, _decode_vec(2.0))
    info = rt.on_finished("r", 70, stopped=True, length_capped=False)
    assert info["decode_probes"] == [(32, _decode_vec(1.0)), (64, _decode_vec(2.0))]


def test_refinement_head_is_checkpointed_beside_the_main_one(weights, refine_weights, tmp_path):
    ckpt = tmp_path / "ckpt.npz"
    config = dict(refine_weights_path=str(refine_weights), checkpoint_path=str(ckpt))
    rt = _runtime(weights, checkpoint_every=1, **config)
    rt.on_probe("r", _vec(0.2))
    rt.on_decode_probe("r", 32, _decode_vec(0.5))
    rt.on_finished("r", 60, stopped=True, length_capped=False)
    restarted = _runtime(weights, **config)
    assert restarted.refine.n_updates == 1
    np.testing.assert_array_equal(restarted.refine.w, rt.refine.w)


def test_refinement_weights_of_another_dimension_are_a_named_error(weights, tmp_path):
    path = tmp_path / "bad.npz"
    LinearLengthModel.fit_ridge(
        np.random.default_rng(0).normal(size=(20, DIM)), np.ones(20) * 9
    ).save(path)
    with pytest.raises(ValueError, match="feature dim"):
        _runtime(weights, refine_weights_path=str(path))
