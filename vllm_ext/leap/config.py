"""LEAP configuration: one frozen dataclass, built by ``load_config(LeapConfig, "leap", ...)``.

Users set it as ``--additional-config '{"leap": {...}}'``: the keys a deployment
needs (the weights, the checkpoint, the aging bound, preemption, refinement) at
the top, ablation switches and tuning constants inside ``"experimental"``.
Every field can also be set as ``VLLMEXT_LEAP_<FIELD>``. Values are checked in
``__post_init__`` so that a directly constructed ``LeapConfig`` is held to the
same rules as one built by :func:`~vllm_ext.common.config.load_config`. The
calibration fit's own constants (ridge penalty, initial RLS covariance) are
options of the calibrate CLI, not serving settings.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from vllm_ext.common.config import ConfigError, load_config, option

SYSTEM = "leap"


@dataclass(frozen=True)
class LeapConfig:
    """Settings of the LEAP scheduler, predictor and online correction."""

    weights_path: str | None = option(
        None,
        path="file",
        doc="calibrated weights (.npz) from the calibrate CLI; None = no prediction (FCFS)",
    )
    layer: int | None = option(
        None,
        doc="decoder layer whose output is probed (0-based); None = num_layers // 2; must be "
        "the calibrate CLI's --layer for weights_path (the weights file does not record it)",
    )
    pooling: Literal["last", "mean"] = option(
        "last",
        doc="hidden state at the last prompt token, or the mean over the prompt; must be the "
        "calibrate CLI's --pooling for weights_path",
    )
    checkpoint_path: str | None = option(
        None, doc="where online-corrected weights are saved; None = not saved"
    )
    max_wait_s: float = option(
        30.0, doc="aging bound: a request waiting longer is served before any non-aged one (> 0)"
    )
    preempt: bool = option(
        True,
        doc="when decode slots are full, preempt the longest predicted remaining runners "
        "for waiting requests expected to be shorter, several per step (SRPT); "
        "False = reorder queues only",
    )
    preempt_token_budget: int | None = option(
        None,
        experimental=True,
        doc="recompute bound on preemption: LEAP's preemptions within the last "
        "preempt_budget_window steps may cost at most this many tokens, each victim counted at "
        "its computed tokens (prompt and output: its recompute if none of its blocks stay "
        "cached); a preemption over the budget is skipped (>= 0; None = count bound only, "
        "max_preemptions)",
    )
    preempt_budget_window: int = option(
        64, experimental=True, doc="steps over which preempt_token_budget is counted (>= 1)"
    )
    refine_weights_path: str | None = option(
        None,
        path="file",
        doc="refinement head (.npz, from calibrate --refine-every): re-predicts the remaining "
        "length from the probe layer's state while decoding; None = prefill prediction only",
    )
    refine_every: int = option(
        32,
        doc="output tokens between two refinements of a request's prediction (>= 1); must be "
        "the calibrate CLI's --refine-every for refine_weights_path",
    )
    checkpoint_every: int = option(
        64, experimental=True, doc="RLS updates between checkpoints (>= 1)"
    )
    online_rls: bool = option(
        True, experimental=True, doc="correct the weights online from true lengths (RLS)"
    )
    forgetting: float = option(
        0.999, experimental=True, doc="RLS forgetting factor, in (0, 1]; 1 = no forgetting"
    )
    risk_k: float = option(
        0.0,
        experimental=True,
        doc="order by predicted remaining inflated by exp(k * log-std) "
        "(>= 0; the log-std is computed only when > 0)",
    )
    remaining: Literal["point", "conditional"] = option(
        "point",
        experimental=True,
        doc="a request's expected remaining tokens: predicted total (at most its max_tokens) "
        "minus generated, at least 1; or the mean under the head's log-normal error given the "
        "tokens already generated and max_tokens (a request past its prediction no longer "
        "looks about to finish); client length hints are exact either way",
    )
    error_log_std: float | None = option(
        None,
        experimental=True,
        doc="spread (std in log1p space) of the head's error for remaining=conditional "
        "(> 0); None = the head's residual std from calibration and RLS",
    )
    prior: Literal["fcfs", "prompt_length"] = option(
        "prompt_length",
        experimental=True,
        doc="order of requests without a prediction yet: shortest prompt, or arrival "
        "(applies only beside a non-constant model)",
    )
    prediction_timeout_s: float = option(
        1.0,
        experimental=True,
        doc="after prefill, how long to wait for a prediction before FCFS for it (> 0)",
    )
    max_len: int = option(
        8192, experimental=True, doc="clamp for the predicted total output length (>= 1)"
    )
    preempt_margin: float = option(
        0.0,
        experimental=True,
        doc="preempt only if the running request's remaining exceeds the waiting one's "
        "expected remaining by this fraction (>= 0)",
    )
    max_preemptions: int = option(
        2, experimental=True, doc="a request is preempted by LEAP at most this often (>= 0)"
    )
    probe_slots: int = option(
        0,
        experimental=True,
        doc="probe lane: while requests without a prediction wait, up to this many of the "
        "max_num_seqs slots prefill them only to read their probe; a probed request that "
        "is not among the shortest is parked again (capped at max_num_seqs - 1; 0 = off)",
    )
    loops: Literal["off", "greedy", "all"] = option(
        "greedy",
        experimental=True,
        doc="repetition loops: a request whose output tail repeats one token cycle is "
        "predicted to run to its max_tokens (exactly, like a client hint); checked for greedy "
        "requests without repetition penalties (where a cycle persists), for all, or never",
    )
    loop_max_period: int = option(
        128, experimental=True, doc="longest token cycle looked for (>= 1)"
    )
    loop_min_span: int = option(
        32,
        experimental=True,
        doc="output tokens a cycle must repeat over (beyond its first occurrence, and at "
        "least one whole cycle) before it counts as a loop (>= 1)",
    )
    loop_check_every: int = option(
        8,
        experimental=True,
        doc="a running request's output is checked for a loop each time its length passes "
        "a multiple of this (>= 1; a speculative step that writes several tokens cannot "
        "skip a check)",
    )
    rls_thread: bool | None = option(
        None,
        experimental=True,
        doc="apply RLS updates (and checkpoints) on a background thread, so the scheduler "
        "never waits for them; None = on when the engine runs on an accelerator, off on CPU "
        "(where the engine's threads already use every core)",
    )
    predictor_thread: bool | None = option(
        None,
        experimental=True,
        doc="predictions and refinements (and RLS, whatever rls_thread says) on LEAP's "
        "background thread: a step never waits for them, a prediction not ready when a step "
        "is scheduled is missing for that step (the request keeps its place), and LEAP falls "
        "back to FCFS order while they lag (keepup_window); None = where RLS runs on the "
        "thread (rls_thread); True puts RLS there too",
    )
    keepup_window: int = option(
        16,
        experimental=True,
        doc="with predictor_thread: how many recent predicted requests decide whether "
        "predictions lag (>= 1)",
    )
    max_late_fraction: float = option(
        0.25,
        experimental=True,
        doc="with predictor_thread: FCFS order while more than this fraction of keepup_window's "
        "predictions were not ready at their first schedule, until the thread has no backlog "
        "(in [0, 1]; 1 = never)",
    )
    probe_delivery: Literal["auto", "same_step", "next_step"] = option(
        "auto",
        experimental=True,
        doc="when the scheduler gets a step's probe vectors: same_step (the worker waits for "
        "the forward to copy them to the host, one sync in each step that ends a prompt) or "
        "next_step (a non-blocking copy, delivered with the next step: no sync, predictions "
        "one step later, and a request that ends in its first step goes unpredicted and "
        "unlearned); auto = next_step on CUDA unless return_probe, else same_step",
    )
    return_probe: bool = option(
        False,
        experimental=True,
        doc="return each request's probe vector (and its refinement probes) in "
        "kv_transfer_params (set by the calibrate CLI)",
    )

    def __post_init__(self) -> None:
        if self.layer is not None:
            _check_int(self, "layer", minimum=0)
        _check_choice(self, "pooling", ("last", "mean"))
        _check_choice(self, "probe_delivery", ("auto", "same_step", "next_step"))
        _check_optional_str(self, "weights_path")
        _check_optional_str(self, "checkpoint_path")
        _check_optional_str(self, "refine_weights_path")
        _check_int(self, "refine_every", minimum=1)
        _check_int(self, "checkpoint_every", minimum=1)
        if not isinstance(self.online_rls, bool):
            raise ConfigError(f"LeapConfig.online_rls must be a boolean, got {self.online_rls!r}")
        _check_float(self, "forgetting", lambda v: 0 < v <= 1, "in (0, 1]")
        _check_float(self, "max_wait_s", lambda v: v > 0, "> 0")
        _check_float(self, "risk_k", lambda v: v >= 0, ">= 0")
        _check_choice(self, "prior", ("fcfs", "prompt_length"))
        _check_choice(self, "remaining", ("point", "conditional"))
        _check_choice(self, "loops", ("off", "greedy", "all"))
        for name in ("loop_max_period", "loop_min_span", "loop_check_every"):
            _check_int(self, name, minimum=1)
        if self.error_log_std is not None:
            _check_float(self, "error_log_std", lambda v: v > 0, "> 0 or None")
        _check_float(self, "prediction_timeout_s", lambda v: v > 0, "> 0")
        _check_int(self, "max_len", minimum=1)
        for name in ("rls_thread", "predictor_thread"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ConfigError(f"LeapConfig.{name} must be a boolean or None, got {value!r}")
        _check_int(self, "keepup_window", minimum=1)
        _check_float(self, "max_late_fraction", lambda v: 0 <= v <= 1, "in [0, 1]")
        if self.preempt_token_budget is not None:
            _check_int(self, "preempt_token_budget", minimum=0)
        _check_int(self, "preempt_budget_window", minimum=1)
        for name in ("preempt", "return_probe"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(
                    f"LeapConfig.{name} must be a boolean, got {getattr(self, name)!r}"
                )
        _check_float(self, "preempt_margin", lambda v: v >= 0, ">= 0")
        _check_int(self, "max_preemptions", minimum=0)
        _check_int(self, "probe_slots", minimum=0)

    def rls_in_background(self, on_cpu: bool) -> bool:
        """Whether RLS runs on its own thread for an engine on the CPU (``on_cpu``) or not."""
        if self.predictor_thread:
            return True  # one thread owns the heads' state
        return (not on_cpu) if self.rls_thread is None else self.rls_thread

    def predictions_in_background(self, on_cpu: bool) -> bool:
        """Whether predictions run on LEAP's thread for an engine on the CPU or not."""
        if self.predictor_thread is None:
            return self.rls_in_background(on_cpu)
        return self.predictor_thread

    def probe_deferred(self, on_cuda: bool) -> bool:
        """Whether the worker delivers probe vectors a step late (``probe_delivery``)."""
        if self.probe_delivery == "auto":
            # calibration (return_probe) wants every vector, even of one-token answers
            return on_cuda and not self.return_probe
        return self.probe_delivery == "next_step"

    @property
    def decode_probe_every(self) -> int:
        """Output tokens between decode probes the worker sends (0: none needed)."""
        return self.refine_every if self.refine_weights_path or self.return_probe else 0

    def resolve_layer(self, num_layers: int) -> int:
        """The probed decoder layer for a model with ``num_layers`` layers.

        Args:
            num_layers: number of decoder layers of the served model (>= 1).

        Returns:
            ``layer``, or ``num_layers // 2`` when ``layer`` is None.

        Raises:
            ConfigError: ``num_layers`` < 1 or ``layer`` >= ``num_layers``.
        """
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
            raise ConfigError(
                f"LeapConfig.layer: num_layers must be an int >= 1, not {num_layers!r}"
            )
        if self.layer is None:
            return num_layers // 2
        if self.layer >= num_layers:
            raise ConfigError(
                f"LeapConfig.layer={self.layer} is out of range for a model with "
                f"{num_layers} layers (valid: 0..{num_layers - 1})"
            )
        return self.layer


def load_leap_config(
    mapping: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None
) -> LeapConfig:
    """``load_config(LeapConfig, "leap", mapping, environ)``: mapping > env > defaults."""
    return load_config(LeapConfig, SYSTEM, mapping, environ)


def _check_int(cfg: LeapConfig, name: str, minimum: int) -> None:
    value = getattr(cfg, name)
    # bool is an int subclass; True as a layer index is a typo, not a value
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"LeapConfig.{name} must be int, got {value!r}")
    if value < minimum:
        raise ConfigError(f"LeapConfig.{name} must be >= {minimum}, got {value}")


def _check_float(cfg: LeapConfig, name: str, ok: Any, rule: str) -> None:
    value = getattr(cfg, name)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"LeapConfig.{name} must be float, got {value!r}")
    # NaN fails every comparison, so `ok` alone would let some rules pass it
    if not math.isfinite(value) or not ok(value):
        raise ConfigError(f"LeapConfig.{name} must be {rule}, got {value}")


def _check_choice(cfg: LeapConfig, name: str, choices: tuple[str, ...]) -> None:
    value = getattr(cfg, name)
    if value not in choices:
        raise ConfigError(f"LeapConfig.{name} must be one of {list(choices)}, got {value!r}")


def _check_optional_str(cfg: LeapConfig, name: str) -> None:
    value = getattr(cfg, name)
    if value is not None and (not isinstance(value, str) or not value):
        raise ConfigError(f"LeapConfig.{name} must be a non-empty path or None, got {value!r}")
