"""Synthetic agentic-coding sessions following aiperf's ``agentic_code_gen`` model.

The distribution parameters come from aiperf's bundled workload
``aiperf/dataset/agentic_code_gen/datasets/1k_sessions_200k_ctx/manifest.json``
(its ``generation_params``); defaults for scalar fields it omits are taken from
the JSON Schema ``agentic_code_gen/configs/spec.json``. Sessions are generated
with numpy only (aiperf itself is never imported), mirroring aiperf's
``SessionSynthesizer``: a layered shared prefix (L1 global tools + system
prompt, L1.5 Zipf-distributed group prefix, L2 per-session prefix), then turns
with lognormal new/output token counts, a fast-agentic / slow-human delay
mixture and a context-dependent reset probability, until the context cap.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from vllm_ext.datasets._lognormal import Lognormal
from vllm_ext.datasets._paths import data_path
from vllm_ext.datasets._schema import deep_merge, read_json, schema_defaults

logger = logging.getLogger(__name__)

DEFAULT_WORKLOAD = "1k_sessions_200k_ctx"
_ACG = ("dataset", "agentic_code_gen")
_SHAKESPEARE = ("dataset", "generator", "assets", "shakespeare.txt")
# Behaviour constants of aiperf's SessionSynthesizer (code, not config):
OUTPUT_MIN_TOKENS = 30  # floor on sampled generation length
DELAY_CONTEXT_SLOPE = 0.8  # delay *= max(floor, 1 - slope * context_ratio)
DELAY_CONTEXT_FLOOR = 0.2


@dataclass(frozen=True)
class AgenticSessionModel:
    """Distribution parameters of the agentic-coding workload (tokens, ms)."""

    new_tokens: Lognormal  # truncation-bias correction already applied
    generation_length: Lognormal
    agentic_fraction: float
    agentic_delay_ms: Lognormal
    human_delay_ms: Lognormal
    max_delay_ms: float | None
    reset_base_probability: float  # 0 disables probabilistic resets
    reset_context_scaling: float
    max_prompt_tokens: int
    block_size: int
    layer1_tokens: int
    layer1_5_tokens: int
    layer2: Lognormal
    num_groups: int
    zipf_alpha: float
    source: str = ""


@dataclass(frozen=True)
class PrefixLayer:
    """A shared prompt prefix; equal ``key`` means identical content."""

    name: str  # "L1", "L1.5" or "L2"
    key: str
    tokens: int


@dataclass(frozen=True)
class Turn:
    """One request: ``new_tokens`` appended to the history, ``delay_s`` after the previous reply."""

    new_tokens: int
    output_tokens: int
    delay_s: float


@dataclass(frozen=True)
class Session:
    """A multi-turn session: prefix layers, then turns that grow the context.

    Turn ``i``'s prompt is the prefix, all earlier turns' new and output
    tokens, then its own ``new_tokens``. Unlike aiperf's trace, where turn 0
    is the bare prefix, every turn (the first too) adds a sampled user message.
    """

    id: str
    group_id: int
    prefix: tuple[PrefixLayer, ...]
    turns: tuple[Turn, ...]
    end_reason: str  # "context_limit" or "reset"

    @property
    def prefix_tokens(self) -> int:
        """Tokens in all prefix layers."""
        return sum(layer.tokens for layer in self.prefix)

    @property
    def total_tokens(self) -> int:
        """Context length after the last reply."""
        return self.prefix_tokens + sum(t.new_tokens + t.output_tokens for t in self.turns)


def _resolve_config(name_or_path: str | Path) -> Path:
    path = Path(name_or_path)
    if path.is_file():
        return path
    base = data_path("aiperf", *_ACG)
    for candidate in (
        base / "datasets" / str(name_or_path) / "manifest.json",
        base / "configs" / f"{name_or_path}.json",
    ):
        if candidate.is_file() and candidate.stem != "spec":
            return candidate
    known = sorted(p.name for p in (base / "datasets").iterdir() if p.is_dir())
    known += sorted(p.stem for p in (base / "configs").glob("*.json") if p.stem != "spec")
    raise FileNotFoundError(f"agentic config {name_or_path!r} not found; known: {known}")


def _model_from_params(p: dict[str, Any], source: str) -> AgenticSessionModel:
    if p.get("turns") is not None:
        raise ValueError(f"{source}: explicit 'turns' mode is not supported")
    ntp, delay, cache = p["new_tokens_per_turn"], p["inter_turn_delay"], p["cache"]
    reset = p.get("reset") or {"base_probability": 0.0, "context_scaling": 1.0}
    groups = cache["layer1_5_groups"]
    return AgenticSessionModel(
        new_tokens=Lognormal.from_params(ntp).biased(float(ntp.get("bias", 1.0))),
        generation_length=Lognormal.from_params(p["generation_length"]),
        agentic_fraction=float(delay["agentic_fraction"]),
        agentic_delay_ms=Lognormal.from_params(delay["agentic_delay"]),
        human_delay_ms=Lognormal.from_params(delay["human_delay"]),
        max_delay_ms=None if delay.get("max") is None else float(delay["max"]),
        reset_base_probability=float(reset["base_probability"]),
        reset_context_scaling=float(reset["context_scaling"]),
        max_prompt_tokens=int(p["max_prompt_tokens"]),
        block_size=int(p["block_size"]),
        layer1_tokens=int(cache["layer1_tokens"]),
        layer1_5_tokens=int(cache["layer1_5_tokens"]),
        layer2=Lognormal.from_params(cache["layer2"]),
        num_groups=int(groups["num_groups"]),
        zipf_alpha=float(groups["zipf_alpha"]),
        source=source,
    )


@functools.lru_cache(maxsize=8)
def load_session_model(name_or_path: str | Path = DEFAULT_WORKLOAD) -> AgenticSessionModel:
    """Read an aiperf agentic-code config into an :class:`AgenticSessionModel`.

    ``name_or_path`` is a workload folder under ``agentic_code_gen/datasets``
    (its ``manifest.json``), a bundled config name (e.g. ``"default"``) or a
    file path. Values missing from it fall back to ``spec.json`` defaults.
    """
    path = _resolve_config(name_or_path)
    raw = read_json(path)
    params = raw.get("generation_params", raw)
    if "$defs" in params:
        raise ValueError(f"{path} is a JSON Schema, not a config")
    spec = read_json(data_path("aiperf", *_ACG, "configs", "spec.json"))
    merged = deep_merge(schema_defaults(spec, spec), params)
    try:
        model = _model_from_params(merged, str(path))
    except KeyError as exc:
        raise ValueError(f"{path}: missing required parameter {exc}") from exc
    logger.info("loaded agentic session model from %s", path)
    return model


def _scaled(tokens: float, scale: float) -> int:
    return 0 if tokens <= 0 else max(1, round(tokens * scale))


def _delay_s(m: AgenticSessionModel, rng: np.random.Generator, ratio: float) -> float:
    dist = m.agentic_delay_ms if rng.random() < m.agentic_fraction else m.human_delay_ms
    factor = max(DELAY_CONTEXT_FLOOR, 1.0 - DELAY_CONTEXT_SLOPE * ratio)
    delay_ms = float(dist.sample(rng)[0]) * factor
    if m.max_delay_ms is not None:
        delay_ms = min(delay_ms, m.max_delay_ms)
    return delay_ms / 1000.0


def _prefix(
    m: AgenticSessionModel, rng: np.random.Generator, sid: str, group: int, scale: float, cap: int
) -> tuple[PrefixLayer, ...]:
    l1, l15 = _scaled(m.layer1_tokens, scale), _scaled(m.layer1_5_tokens, scale)
    room = cap - l1 - l15 - 2  # leave space for one new and one output token
    if room < 1:
        raise ValueError(f"prefix layers do not fit the context cap {cap} at scale {scale}")
    l2 = min(_scaled(max(1.0, float(m.layer2.sample(rng)[0])), scale), room)
    layers = (
        PrefixLayer("L1", "L1", l1),
        PrefixLayer("L1.5", f"L1.5/g{group}", l15),
        PrefixLayer("L2", f"L2/{sid}", l2),
    )
    return tuple(layer for layer in layers if layer.tokens > 0)


def _session(
    m: AgenticSessionModel, index: int, seed: int, scale: float, weights: np.ndarray
) -> Session:
    rng = np.random.default_rng(np.random.SeedSequence([seed, index]))
    sid, group = f"agentic-{seed}-{index:05d}", int(rng.choice(m.num_groups, p=weights))
    cap = max(1, math.floor(m.max_prompt_tokens * scale))
    prefix = _prefix(m, rng, sid, group, scale, cap)
    context = sum(layer.tokens for layer in prefix)
    turns: list[Turn] = []
    end_reason = "context_limit"
    while True:
        delay = _delay_s(m, rng, context / cap) if turns else 0.0
        new = _scaled(max(1.0, float(m.new_tokens.sample(rng)[0])), scale)
        if turns and context + new >= cap:
            break
        ratio = (context + new) / cap
        p_reset = m.reset_base_probability * (1.0 + (m.reset_context_scaling - 1.0) * ratio)
        if turns and rng.random() < p_reset:
            end_reason = "reset"
            break
        gen = float(m.generation_length.sample(rng, clip_min=OUTPUT_MIN_TOKENS)[0])
        out = _scaled(gen, scale)
        if context + new + out > cap:
            if turns:
                break
            new = max(1, min(new, cap - context - 1))
            out = max(1, min(out, cap - context - new))
        turns.append(Turn(new_tokens=new, output_tokens=out, delay_s=delay))
        context += new + out
    return Session(sid, group, prefix, tuple(turns), end_reason)


def generate_sessions(
    n_sessions: int,
    *,
    seed: int,
    scale: float = 1.0,
    model: AgenticSessionModel | None = None,
) -> list[Session]:
    """Generate ``n_sessions`` sessions, deterministic by ``seed``.

    Session ``i`` depends only on ``(seed, i)``. ``scale`` multiplies every
    token count (non-zero counts stay >= 1) and the context cap; delays are
    not scaled. Every session has at least one turn and its final context
    (prefix + all new and output tokens) fits within ``max_prompt_tokens * scale``.
    """
    if n_sessions < 0:
        raise ValueError(f"n_sessions must be >= 0, got {n_sessions}")
    if not (scale > 0 and math.isfinite(scale)):
        raise ValueError(f"scale must be a positive finite number, got {scale}")
    m = model or load_session_model()
    ranks = np.arange(1, m.num_groups + 1, dtype=float)
    weights = ranks**-m.zipf_alpha
    weights /= weights.sum()
    sessions = [_session(m, i, seed, scale, weights) for i in range(n_sessions)]
    logger.debug("generated %d agentic sessions (seed=%d, scale=%s)", n_sessions, seed, scale)
    return sessions


@functools.lru_cache(maxsize=1)
def _corpus_words() -> tuple[str, ...]:
    text = data_path("aiperf", *_SHAKESPEARE).read_text(encoding="utf-8")
    return tuple(text.split())


def synthetic_text(n_words: int, seed: int) -> str:
    """``n_words`` consecutive words of aiperf's Shakespeare corpus, start chosen by ``seed``."""
    if n_words < 0:
        raise ValueError(f"n_words must be >= 0, got {n_words}")
    words = _corpus_words()
    start = int(np.random.default_rng(seed).integers(len(words)))
    return " ".join(words[(start + i) % len(words)] for i in range(n_words))
