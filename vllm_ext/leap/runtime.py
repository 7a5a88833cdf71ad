"""Scheduler-process state of LEAP: probe vectors in, predictions out, RLS on finish.

Pure Python + numpy (no vLLM): the LeapConnector feeds it probe vectors from
the worker and finished requests; the LeapScheduler reads predictions. The
linear head runs here, on the CPU of the EngineCore process, off the
accelerator: one batched prediction per step. RLS updates (O(hidden^2) each)
run on a background thread when the engine has an accelerator
(``rls_thread``), so the scheduler never waits for them.

Failure rule: any problem with one request's prediction (non-finite vector,
predictor error, no vector within ``prediction_timeout_s``) leaves that
request without a prediction — it is then ordered like vLLM's FCFS — with one
warning per kind and a counter; nothing fails the request.
"""

from __future__ import annotations

import math
import os
import time
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from vllm_ext.common.counters import Counters, CounterSpec
from vllm_ext.common.log import get_logger
from vllm_ext.leap.config import LeapConfig
from vllm_ext.leap.predictor import LinearLengthModel, Prediction, use_one_blas_thread
from vllm_ext.leap.refine import refine_features, refined_prediction, refined_predictions
from vllm_ext.leap.remaining import expected_remaining

logger = get_logger(__name__)

# vLLM extra_args key (OpenAI API: "vllm_xargs") of a client-supplied length
HINT_KEY = "leap_predicted_tokens"

COUNTERS = (
    CounterSpec("predictions", "requests that received a length prediction"),
    CounterSpec("fallbacks", "requests ordered FCFS because their prediction failed or timed out"),
    CounterSpec("rls_updates", "online RLS corrections from finished requests"),
    CounterSpec("rls_skipped", "finished requests not used for RLS (aborted, censored, bad)"),
    CounterSpec("abs_log_error_sum", "sum of |log1p(predicted) - log1p(true)| over RLS updates"),
    CounterSpec("checkpoints", "weights+covariance checkpoints written"),
    CounterSpec("preemptions", "running requests LEAP preempted for a shorter waiting one"),
    CounterSpec("lane_probes", "requests admitted through the probe lane to read their probe"),
    CounterSpec("refinements", "remaining-length predictions refined from a decode probe"),
    CounterSpec("refine_rls_updates", "online RLS corrections of the refinement head"),
    CounterSpec("loops", "requests found repeating a token cycle (predicted to run to max_tokens)"),
)


@dataclass
class _Entry:
    features: np.ndarray | None = None
    prediction: Prediction | None = None  # the current one: refined while decoding
    prefill_prediction: Prediction | None = None  # the prefill head's
    prefill_done_at: float | None = None
    failed: bool = False
    hinted: bool = False  # the prediction came from the client and outranks the probe
    looped: bool = False  # its output repeats a cycle: it runs to its cap (outranks the probe)
    # (features, generated, predicted total) of each refinement, for its RLS
    refinements: list[tuple[np.ndarray, int, float]] = field(default_factory=list)
    decode_probes: list[tuple[int, list[float]]] = field(default_factory=list)  # return_probe

    @property
    def initial_prediction(self) -> Prediction | None:
        """The prediction before any refinement: the prefill head's, or a client hint."""
        return self.prefill_prediction or self.prediction


class LeapRuntime:
    """Predictions per live request and the online-corrected model.

    Args:
        config: the LEAP config; ``weights_path=None`` means no predictions.
        counters: where counts go (published on ``/metrics`` by the connector).
        clock: seconds, monotonic; injectable for tests.
    """

    def __init__(
        self,
        config: LeapConfig,
        counters: Counters,
        clock: Callable[[], float] = time.monotonic,
        hidden_size: int | None = None,
        background_rls: bool = False,
    ):
        self.config = config
        self.counters = counters
        self.clock = clock
        self.model: LinearLengthModel | None = None
        if config.weights_path:
            # a checkpoint of earlier online corrections wins over the calibrated file
            source = config.checkpoint_path if _exists(config.checkpoint_path) else None
            self.model = LinearLengthModel.load(source or config.weights_path, dim=hidden_size)
            logger.info(
                "LEAP predictor loaded from %s (%d features)",
                source or config.weights_path,
                self.model.num_features,
            )
            use_one_blas_thread()  # see there: BLAS threads only wait in an engine
        self.refine: LinearLengthModel | None = None
        if config.refine_weights_path and self.model is not None:
            source = _refine_checkpoint(config.checkpoint_path)
            source = source if _exists(source) else config.refine_weights_path
            dim = hidden_size + 2 if hidden_size is not None else None
            self.refine = LinearLengthModel.load(source, dim=dim)
            logger.info("LEAP refinement head loaded from %s", source)
        self._entries: dict[str, _Entry] = {}
        # the uncertainty costs O(D^2) per prediction (the mean O(D)); only risk_k reads it
        self._with_std = config.risk_k > 0
        # predicted totals of live requests (distinct_predictions) and the ids whose
        # prediction changed since the scheduler last looked (take_changed)
        self._totals: Counter[float] = Counter()
        self._changed: set[str] = set()
        self._updates_since_checkpoint = 0
        self._warned: set[str] = set()
        # log1p of recent finished lengths: the prior when there is no model
        self._length_stats: deque[float] = deque(maxlen=256)
        # one worker keeps the updates in finishing order: the same weights as inline
        self._rls_pool = (
            ThreadPoolExecutor(1, thread_name_prefix="leap-rls") if background_rls else None
        )
        self._last_rls: Future | None = None

    @property
    def active(self) -> bool:
        return self.model is not None

    @property
    def informative(self) -> bool:
        """A model that tells requests apart (loaded, not constant; RLS may make it so)."""
        return self.model is not None and not self.model.is_constant

    @property
    def distinct_predictions(self) -> int:
        """How many different predicted totals the live requests have (hints included)."""
        return len(self._totals)

    def take_changed(self) -> set[str]:
        """Ids whose prediction changed (set, refined, failed) since the last call."""
        changed, self._changed = self._changed, set()
        return changed

    def _set_prediction(self, req_id: str, entry: _Entry, prediction: Prediction | None):
        if prediction is entry.prediction:
            return  # e.g. a failure of a request that had none: nothing to re-key
        if entry.prediction is not None:
            self._uncount(entry.prediction)
        if prediction is not None:
            self._totals[prediction.total_tokens] += 1
        entry.prediction = prediction
        self._changed.add(req_id)

    def _uncount(self, prediction: Prediction) -> None:
        total = prediction.total_tokens
        self._totals[total] -= 1
        if not self._totals[total]:
            del self._totals[total]

    @property
    def typical_tokens(self) -> float | None:
        """Typical total length of a request not prefilled yet (None: nothing known yet).

        With a model: its bias — features are standardised, so the bias is the
        prediction for the average probe vector (the calibration mean of
        log(1 + length)). Without one (length hints only): the geometric mean
        of recent finished lengths. The policy treats such a request as one
        predicted at this length (:meth:`prior_remaining`).
        """
        if self.model is not None:
            log_len = float(self.model.w[-1])
        elif self._length_stats:
            log_len = sum(self._length_stats) / len(self._length_stats)
        else:
            return None
        return float(min(max(math.expm1(log_len), 1.0), self.config.max_len))

    def prior_remaining(self, caps) -> np.ndarray | None:
        """Expected remaining tokens of requests not prefilled yet, one per output cap.

        Each counts as a request predicted at :attr:`typical_tokens` that may
        write at most ``cap`` tokens, in the units runners are compared in (so a
        waiting request with max_tokens 10 counts as at most 10):
        ``min(typical, cap)`` under the point rule, the capped log-normal mean
        under ``remaining=conditional``. Ascending caps give ascending values.
        None: nothing known yet.
        """
        typical = self.typical_tokens
        if typical is None:
            return None
        # spread 0 (the point rule) is max(min(typical, cap), 1) there
        return expected_remaining(typical, 0, self.error_log_std, caps)

    @property
    def error_log_std(self) -> float:
        """Spread of the head's error in log1p space for ``remaining=conditional``
        (0: predictions are taken as exact, the ``point`` remaining)."""
        if self.config.remaining == "point" or self.model is None:
            return 0.0
        if self.config.error_log_std is not None:
            return self.config.error_log_std
        return math.sqrt(max(self.model.noise_var, 0.0))

    def _warn_once(self, kind: str, msg: str, *args) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            logger.warning(msg, *args)

    def on_probes(self, vectors: dict) -> None:
        """The probe vectors of one step: one batched prediction for all of them.

        Per request (so a bad vector fails only its own request) when the batch
        prediction fails or there is a single vector.
        """
        predictions = {}
        if self.model is not None and len(vectors) > 1:
            try:
                X = np.asarray(list(vectors.values()), dtype=np.float64)
                batch = self.model.predict_batch(X, self.config.max_len, self._with_std)
                predictions = {req_id: batch.row(i) for i, req_id in enumerate(vectors)}
            except Exception:  # on_probe names the failing request(s) and falls back to FCFS
                pass
        for req_id, vector in vectors.items():
            self.on_probe(req_id, vector, predictions.get(req_id))

    def on_probe(self, req_id: str, vector, prediction: Prediction | None = None) -> None:
        """A probe vector arrived for ``req_id`` (prefill done, maybe again after preemption).

        ``prediction``: the head's prediction for ``vector`` when the caller
        already made it (:meth:`on_probes`).
        """
        entry = self._entries.setdefault(req_id, _Entry())
        entry.prefill_done_at = entry.prefill_done_at or self.clock()
        entry.features = np.asarray(vector, dtype=np.float64)
        # features are still kept for RLS: the true length teaches the head either way
        if self.model is None or entry.hinted:
            return
        try:
            if prediction is None:
                prediction = self.model.predict(entry.features, self.config.max_len, self._with_std)
        except Exception as exc:  # any predictor failure degrades to FCFS for this request
            entry.features = None
            msg = "LEAP prediction failed (%s); request keeps FCFS order"
            self._fail(req_id, entry, "predict", msg, exc)
            return
        if entry.prediction is None:
            self.counters.inc("predictions")
        entry.prefill_prediction, entry.failed = prediction, False
        # a preempted request's prompt recompute re-sends the probe: what was
        # learned since (a refinement, a loop) stays
        if not (entry.refinements or entry.looped):
            self._set_prediction(req_id, entry, prediction)

    def on_decode_probes(self, probes: dict) -> None:
        """The decode probes of one step (``{req_id: (generated, vector)}``): one batched
        refinement (per request where the batch fails)."""
        refinable = [r for r in probes if self._refinable(r)]
        predictions = {}
        if len(refinable) > 1:
            try:
                features = np.stack([self._refine_features(r, *probes[r]) for r in refinable])
                generated = [probes[r][0] for r in refinable]
                batch = refined_predictions(
                    self.refine, features, generated, self.config.max_len, self._with_std
                )
                predictions = dict(zip(refinable, zip(features, batch, strict=True), strict=True))
            except Exception:  # on_decode_probe warns about the failing request
                pass
        for req_id, (generated, vector) in probes.items():
            self.on_decode_probe(req_id, generated, vector, predictions.get(req_id))

    def on_decode_probe(self, req_id: str, generated: int, vector, refined=None) -> None:
        """A decode probe after ``generated`` output tokens: refine the remaining length.

        ``refined``: ``(features, prediction)`` when the caller already made
        them (:meth:`on_decode_probes`). A failed refinement keeps the current
        prediction (one warning).
        """
        entry = self._entries.get(req_id)
        if entry is None:
            return  # no prefill probe seen (aborted meanwhile): nothing to refine
        if self.config.return_probe:
            entry.decode_probes.append((int(generated), np.asarray(vector, float).tolist()))
        if not self._refinable(req_id):
            return
        try:
            if refined is None:
                features = self._refine_features(req_id, generated, vector)
                prediction = refined_prediction(
                    self.refine, features, generated, self.config.max_len, self._with_std
                )
            else:
                features, prediction = refined
        except Exception as exc:  # the prefill prediction stays; never fail the request
            self._warn_once("refine", "LEAP refinement failed (%s); prediction unchanged", exc)
            return
        self._set_prediction(req_id, entry, prediction)
        entry.refinements.append((features, int(generated), prediction.total_tokens))
        self.counters.inc("refinements")

    def _refinable(self, req_id: str) -> bool:
        entry = self._entries.get(req_id)
        return not (
            entry is None
            or self.refine is None
            or entry.hinted
            or entry.looped
            or entry.prefill_prediction is None
        )

    def on_loop(self, req_id: str, max_tokens: float) -> None:
        """``req_id``'s output repeats a cycle (:mod:`~vllm_ext.leap.loops`): it will
        write all ``max_tokens``. An exact prediction from then on, like a hint."""
        entry = self._entries.get(req_id)  # none: finished or never seen; nothing to keep
        if entry is None or entry.hinted or entry.looped:
            return
        total = float(min(max_tokens, self.config.max_len))
        entry.looped = True
        self._set_prediction(req_id, entry, Prediction(math.log1p(total), 0.0, total))
        self.counters.inc("loops")

    def watches_loops(self, req_id: str) -> bool:
        """Whether a loop check of ``req_id`` could still change anything."""
        return req_id in self._entries and not self.is_exact(req_id)

    def is_exact(self, req_id: str) -> bool:
        """Whether ``req_id``'s prediction is taken as exact (a client hint, a loop)."""
        entry = self._entries.get(req_id)
        return entry is not None and (entry.hinted or entry.looped)

    def _refine_features(self, req_id: str, generated: int, vector) -> np.ndarray:
        base = self._entries[req_id].prefill_prediction
        return refine_features(vector, generated, base.log_mean)

    def _fail(self, req_id: str, entry: _Entry, kind: str, msg: str, *args) -> None:
        if not entry.failed:
            self.counters.inc("fallbacks")
        entry.failed = True
        self._set_prediction(req_id, entry, None)
        self._warn_once(kind, msg, *args)

    def on_scheduled_prefill_done(self, req_id: str) -> None:
        """The scheduler saw ``req_id`` finish its prompt; start the timeout clock."""
        entry = self._entries.setdefault(req_id, _Entry())
        if entry.prefill_done_at is None:
            entry.prefill_done_at = self.clock()

    def prediction(self, req_id: str, hint=None) -> Prediction | None:
        """The current prediction, or None (no model, not yet, or failed).

        ``hint``: a length the client sent with the request (vLLM ``extra_args``
        key :data:`HINT_KEY`); it replaces the probe's prediction. Baselines
        (oracle, separate encoders) reach the same scheduler this way.
        """
        if hint is not None:
            return self._hint_prediction(req_id, hint)
        entry = self._entries.get(req_id)
        if entry is None or entry.prediction is not None or self.model is None:
            return entry.prediction if entry else None
        if not entry.failed and entry.prefill_done_at is not None:
            if self.clock() - entry.prefill_done_at > self.config.prediction_timeout_s:
                self._fail(
                    req_id,
                    entry,
                    "timeout",
                    "LEAP prediction did not arrive within %.1f s; request keeps FCFS order",
                    self.config.prediction_timeout_s,
                )
        return entry.prediction

    def _hint_prediction(self, req_id: str, hint) -> Prediction | None:
        entry = self._entries.setdefault(req_id, _Entry())
        if entry.prediction is not None:
            return entry.prediction
        try:
            total = float(hint)
            if not (math.isfinite(total) and total > 0):
                raise ValueError(hint)
        except (TypeError, ValueError):
            self._fail(
                req_id,
                entry,
                "hint",
                "LEAP ignores length hint %r (not a positive number); request keeps FCFS order",
                hint,
            )
            return None
        total = min(total, float(self.config.max_len))
        prediction = Prediction(log_mean=math.log1p(total), log_std=0.0, total_tokens=total)
        self._set_prediction(req_id, entry, prediction)
        entry.hinted = True
        self.counters.inc("predictions")
        return entry.prediction

    def on_finished(
        self, req_id: str, output_tokens: int, *, stopped: bool, length_capped: bool
    ) -> dict:
        """Correct the model with the true length; return what the client gets back."""
        entry = self._entries.pop(req_id, None) or _Entry()
        if entry.prediction is not None:
            self._uncount(entry.prediction)
        self._changed.discard(req_id)
        initial = entry.initial_prediction
        predicted = initial.total_tokens if initial else None
        if stopped or length_capped:
            self._length_stats.append(math.log1p(output_tokens))
        if self._rls_pool is None:
            self._learn(entry, output_tokens, stopped, length_capped)
        else:  # O(D^2) per update: off the scheduler's step
            self._last_rls = self._rls_pool.submit(
                self._learn, entry, output_tokens, stopped, length_capped
            )
        info = {"predicted_tokens": predicted, "output_tokens": output_tokens}
        if self.config.return_probe:
            info["probe"] = entry.features.tolist() if entry.features is not None else None
            info["decode_probes"] = entry.decode_probes
        return info

    def _learn(self, entry: _Entry, output_tokens: int, stopped: bool, length_capped: bool):
        """RLS on both heads from one finished request; a checkpoint when one is due."""
        # before the main head's update, whose checkpoint then includes this one
        self._update_refine(entry, output_tokens, stopped, length_capped)
        if self._use_for_rls(entry, output_tokens, stopped, length_capped):
            try:
                error = self.model.rls_update(entry.features, output_tokens, self.config.forgetting)
            except Exception as exc:  # a correction must never take the engine down
                self._warn_once("rls", "LEAP RLS update failed (%s); weights unchanged", exc)
                error = None
            if error is None:
                self.counters.inc("rls_skipped")
            else:
                self.counters.inc("rls_updates")
                self.counters.inc("abs_log_error_sum", abs(float(error)))
                self._maybe_checkpoint()
        elif self.model is not None:
            self.counters.inc("rls_skipped")

    @property
    def background_rls(self) -> bool:
        """True when RLS updates run on the background thread."""
        return self._rls_pool is not None

    def drain(self, timeout: float | None = None) -> None:
        """Wait until every RLS update handed to the background thread is applied."""
        if self._last_rls is not None:
            self._last_rls.result(timeout)

    def close(self) -> None:
        """Apply the pending RLS updates (and checkpoints), then stop the background thread."""
        if self._rls_pool is not None:
            self._rls_pool.shutdown(wait=True)

    def _update_refine(
        self, entry: _Entry, output_tokens: int, stopped: bool, length_capped: bool
    ) -> None:
        """RLS on the refinement head, one step per refinement, same censoring rule."""
        if not (self.config.online_rls and self.refine is not None):
            return
        for features, generated, predicted_total in entry.refinements:
            if not (stopped or (length_capped and predicted_total < output_tokens)):
                continue
            remaining = max(output_tokens - generated, 0)
            try:
                error = self.refine.rls_update(features, remaining, self.config.forgetting)
            except Exception as exc:  # a correction must never take the engine down
                self._warn_once("refine_rls", "LEAP refinement RLS failed (%s)", exc)
                return
            if error is not None:
                self.counters.inc("refine_rls_updates")

    def _use_for_rls(
        self, entry: _Entry, output_tokens: int, stopped: bool, length_capped: bool
    ) -> bool:
        if not (self.config.online_rls and self.model is not None and entry.features is not None):
            return False
        if stopped:
            return True
        # a length-capped request's true length is only known to be >= the cap:
        # learning the cap is right exactly when we predicted less than it
        initial = entry.initial_prediction
        return bool(length_capped and initial is not None and initial.total_tokens < output_tokens)

    def _maybe_checkpoint(self) -> None:
        self._updates_since_checkpoint += 1
        path = self.config.checkpoint_path
        if path and self._updates_since_checkpoint >= self.config.checkpoint_every:
            self._updates_since_checkpoint = 0
            try:
                self.model.save(path)
                if self.refine is not None:
                    self.refine.save(_refine_checkpoint(path))
                self.counters.inc("checkpoints")
            except OSError as exc:
                self._warn_once("checkpoint", "LEAP checkpoint to %s failed: %s", path, exc)

    def num_live(self) -> int:
        return len(self._entries)


def _refine_checkpoint(path: str | None) -> str | None:
    """Where the refinement head's checkpoint lives beside the main one."""
    return f"{path}.refine.npz" if path else None


def _exists(path: str | None) -> bool:
    return bool(path) and os.path.exists(path)
