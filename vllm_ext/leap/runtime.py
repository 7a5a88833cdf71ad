"""Scheduler-process state of LEAP: probe vectors in, predictions out, RLS on finish.

Pure Python + numpy (no vLLM): the LeapConnector feeds it probe vectors from
the worker and finished requests; the LeapScheduler reads predictions. The
linear head runs here, on the CPU of the EngineCore process, off the
accelerator: one batched prediction per step. RLS updates (O(hidden^2) each)
run on a background thread when the engine has an accelerator
(``rls_thread``), so the scheduler never waits for them; with
``predictor_thread`` the predictions and refinements run there too
(:mod:`~vllm_ext.leap.offload`): the step picks up what is ready
(:meth:`LeapRuntime.collect_ready`), a prediction not ready is a missing one,
and when too many are late LEAP falls back to FCFS order until the thread
catches up (:attr:`LeapRuntime.fcfs_fallback`).

Seconds spent on the scheduler's step thread are counted per component
(``sched_*_seconds``), so a run can say which part costs the step its time.

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
from dataclasses import dataclass, field

import numpy as np

from vllm_ext.common.counters import Counters, CounterSpec, GaugeSpec, HistogramSpec
from vllm_ext.common.log import get_logger
from vllm_ext.leap.config import LeapConfig
from vllm_ext.leap.offload import Job, KeepUp, PredictorThread
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
    CounterSpec(
        "late_predictions",
        "predictions not ready at the first schedule after their probe arrived (predictor thread)",
    ),
    CounterSpec("fcfs_fallbacks", "times LEAP fell back to FCFS order: its predictions were late"),
    CounterSpec("fcfs_fallback_steps", "steps scheduled in FCFS order because predictions lagged"),
    CounterSpec("preempted_tokens", "computed tokens of the requests LEAP preempted (recompute)"),
    CounterSpec(
        "preemptions_over_budget",
        "preemptions LEAP skipped (once per step asked) as their recompute exceeded the budget",
    ),
    # seconds on the scheduler's step thread, per component (the step waits for all of them)
    CounterSpec("sched_order_seconds", "LEAP's queue order, SRPT pairing and preemption per step"),
    CounterSpec("sched_predict_seconds", "predictions on the step (or handing off, taking them)"),
    CounterSpec("sched_refine_seconds", "refinements on the step (or handing them off)"),
    CounterSpec("sched_rls_seconds", "RLS updates on the step (or handing them off)"),
    # off the step: the worker's probe read-out, and the background thread's busy time
    CounterSpec("worker_probe_seconds", "worker: reading the probe vectors out after a forward"),
    CounterSpec("predictor_thread_seconds", "busy time of LEAP's background thread (off the step)"),
    # what users graph: the queues LEAP orders, and how far its predictions miss
    GaugeSpec("queue_length", "requests in the scheduler's queues LEAP orders", label="queue"),
    HistogramSpec(
        "prediction_abs_log_error",
        "|log1p(predicted) - log1p(true)| of each finished request used for RLS",
        (0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0),
    ),
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
        background_predictor: bool = False,
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
        # one worker keeps the updates in finishing order: the same weights as inline.
        # Predictions share it, so that only that thread ever touches the heads' state.
        self.predictor_thread = (
            PredictorThread(counters) if background_rls or background_predictor else None
        )
        self._predict_in_background = background_predictor
        self.keep_up = KeepUp(config.keepup_window, config.max_late_fraction)

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

    @property
    def fcfs_fallback(self) -> bool:
        """True while predictions lag (see :class:`~vllm_ext.leap.offload.KeepUp`): order
        requests as vLLM's FCFS would, ignoring predictions and hints."""
        return self.keep_up.fallback

    def on_probes(self, vectors: dict) -> None:
        """The probe vectors of one step: one batched prediction for all of them.

        Per request (so a bad vector fails only its own request) when the batch
        prediction fails or there is a single vector. With ``predictor_thread``
        the prediction is handed to the thread and applied by :meth:`collect_ready`.
        """
        started = time.perf_counter()
        if self._predict_in_background and self.model is not None:
            self._submit_predictions(vectors)
        else:
            self._predict_inline(vectors)
        self.counters.inc("sched_predict_seconds", time.perf_counter() - started)

    def _predict_inline(self, vectors: dict) -> None:
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
        entry = self._entry_for_probe(req_id, vector)
        # features are still kept for RLS: the true length teaches the head either way
        if self.model is None or entry.hinted:
            return
        try:
            if prediction is None:
                prediction = self.model.predict(entry.features, self.config.max_len, self._with_std)
        except Exception as exc:  # any predictor failure degrades to FCFS for this request
            self._prediction_failed(req_id, entry, exc)
            return
        self._apply_prediction(req_id, entry, prediction)

    def _entry_for_probe(self, req_id: str, vector) -> _Entry:
        entry = self._entries.setdefault(req_id, _Entry())
        entry.prefill_done_at = entry.prefill_done_at or self.clock()
        entry.features = np.asarray(vector, dtype=np.float64)
        return entry

    def _prediction_failed(self, req_id: str, entry: _Entry, exc: Exception) -> None:
        entry.features = None
        msg = "LEAP prediction failed (%s); request keeps FCFS order"
        self._fail(req_id, entry, "predict", msg, exc)

    def _apply_prediction(self, req_id: str, entry: _Entry, prediction: Prediction) -> None:
        if entry.prediction is None:
            self.counters.inc("predictions")
        entry.prefill_prediction, entry.failed = prediction, False
        # a preempted request's prompt recompute re-sends the probe: what was
        # learned since (a refinement, a loop) stays
        if not (entry.refinements or entry.looped):
            self._set_prediction(req_id, entry, prediction)

    def on_decode_probes(self, probes: dict) -> None:
        """The decode probes of one step (``{req_id: (generated, vector)}``): one batched
        refinement (per request where the batch fails); on the predictor thread with
        ``predictor_thread``."""
        started = time.perf_counter()
        if self._predict_in_background:
            self._submit_refinements(probes)
        else:
            self._refine_inline(probes)
        self.counters.inc("sched_refine_seconds", time.perf_counter() - started)

    def _refine_inline(self, probes: dict) -> None:
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
        self._apply_refinement(req_id, entry, generated, features, prediction)

    def _apply_refinement(self, req_id, entry, generated, features, prediction) -> None:
        self._set_prediction(req_id, entry, prediction)
        entry.refinements.append((features, int(generated), prediction.total_tokens))
        self.counters.inc("refinements")

    # --- the predictor thread: hand work off on the step, apply what is ready next step

    def _submit_predictions(self, vectors: dict) -> None:
        ids, rows = [], []
        for req_id, vector in vectors.items():
            entry = self._entry_for_probe(req_id, vector)
            if not entry.hinted:
                ids.append(req_id)
                rows.append(entry.features)
        if ids:
            self.predictor_thread.submit_job(
                "predict", self._predict_rows, rows, watched=ids, ids=ids
            )

    def _predict_rows(self, rows: list) -> list:
        """On the thread: a prediction (or the exception) per row, batched where possible."""
        max_len, with_std = self.config.max_len, self._with_std
        if len(rows) > 1:
            try:
                batch = self.model.predict_batch(np.stack(rows), max_len, with_std)
                return [batch.row(i) for i in range(len(rows))]
            except Exception:  # per row below, so that a bad vector fails only its request
                pass
        out = []
        for row in rows:
            try:
                out.append(self.model.predict(row, max_len, with_std))
            except Exception as exc:
                out.append(exc)
        return out

    def _submit_refinements(self, probes: dict) -> None:
        work = []
        for req_id, (generated, vector) in probes.items():
            entry = self._entries.get(req_id)
            if entry is not None and self.config.return_probe:
                entry.decode_probes.append((int(generated), np.asarray(vector, float).tolist()))
            if self._refinable(req_id):
                work.append((req_id, int(generated), vector, entry.prefill_prediction.log_mean))
        if work:
            self.predictor_thread.submit_job("refine", self._refine_rows, work, work=work)

    def _refine_rows(self, work: list) -> list:
        """On the thread: ``(features, prediction)`` (or the exception) per decode probe,
        batched as inline where possible."""
        if len(work) > 1:
            try:
                features = np.stack([refine_features(v, g, m) for _, g, v, m in work])
                generated = [g for _, g, _, _ in work]
                batch = refined_predictions(
                    self.refine, features, generated, self.config.max_len, self._with_std
                )
                return list(zip(features, batch, strict=True))
            except Exception:  # per row below: a bad probe fails only its own refinement
                pass
        out = []
        for _, generated, vector, log_mean in work:
            try:
                features = refine_features(vector, generated, log_mean)
                prediction = refined_prediction(
                    self.refine, features, generated, self.config.max_len, self._with_std
                )
                out.append((features, prediction))
            except Exception as exc:
                out.append(exc)
        return out

    def collect_ready(self) -> None:
        """Apply the predictor thread's finished work, never waiting for the rest.

        Called at the start of each schedule. A prefill prediction still pending
        after a whole step is late (:data:`~vllm_ext.leap.offload.LATE_AFTER_SCHEDULES`,
        :class:`~vllm_ext.leap.offload.KeepUp`).
        """
        thread = self.predictor_thread
        if thread is None or not self._predict_in_background:
            return
        started = time.perf_counter()
        ready, late = thread.take_ready()
        for job in ready:
            if not job.late:  # in time
                for _ in job.watched:
                    self.keep_up.record(late=False)
            self._apply_job(job)
        for job in late:
            for _ in job.watched:
                self.keep_up.record(late=True)
            self.counters.inc("late_predictions", len(job.watched))
        fallback, entered = self.keep_up.update(thread.backlog)
        if entered:
            self.counters.inc("fcfs_fallbacks")
            logger.warning(
                "LEAP predictions lag (%d of the last %d late): FCFS order until they catch up",
                self.keep_up.late,
                self.keep_up.window,
            )
        self.counters.inc("sched_predict_seconds", time.perf_counter() - started)

    def _apply_job(self, job: Job) -> None:
        results = job.future.result()
        if job.kind == "predict":
            for req_id, result in zip(job.context["ids"], results, strict=True):
                entry = self._entries.get(req_id)
                if entry is None or entry.hinted:
                    continue  # finished (or hinted) meanwhile
                if isinstance(result, Exception):
                    self._prediction_failed(req_id, entry, result)
                else:
                    self._apply_prediction(req_id, entry, result)
            return
        for (req_id, generated, _, _), result in zip(job.context["work"], results, strict=True):
            if not self._refinable(req_id):
                continue
            if isinstance(result, Exception):
                msg = "LEAP refinement failed (%s); prediction unchanged"
                self._warn_once("refine", msg, result)
                continue
            self._apply_refinement(req_id, self._entries[req_id], generated, *result)

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
        started = time.perf_counter()
        if self.predictor_thread is None:
            self._learn(entry, output_tokens, stopped, length_capped)
        else:  # O(D^2) per update: off the scheduler's step
            self.predictor_thread.submit(self._learn, entry, output_tokens, stopped, length_capped)
        self.counters.inc("sched_rls_seconds", time.perf_counter() - started)
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
                self.counters.observe("prediction_abs_log_error", abs(float(error)))
                self._maybe_checkpoint()
        elif self.model is not None:
            self.counters.inc("rls_skipped")

    @property
    def background_rls(self) -> bool:
        """True when RLS updates run on the background thread."""
        return self.predictor_thread is not None

    @property
    def background_predictions(self) -> bool:
        """True when predictions and refinements run on the background thread."""
        return self._predict_in_background

    def drain(self, timeout: float | None = None) -> None:
        """Wait until all work handed to the background thread has run (the next
        :meth:`collect_ready` applies its predictions)."""
        if self.predictor_thread is not None:
            self.predictor_thread.drain(timeout)

    def close(self) -> None:
        """Apply the pending RLS updates (and checkpoints), then stop the background thread."""
        if self.predictor_thread is not None:
            self.predictor_thread.close()

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
