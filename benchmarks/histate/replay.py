"""Closed-loop replay of a saved HiState trace against a real engine (no vLLM here).

A trace (``vllm_ext.histate.traces``) names prompts by their block-hash chain,
not by tokens. To serve it, each session is turned into token ids:

- turn 0's prompt: block ``j`` of the chain becomes ``block_size`` token ids
  drawn from a generator seeded by the block's hash, so requests sharing a
  prefix chain (aiperf's shared tool/system layers, BFCL tool schemas) share
  exactly those tokens; the tail past the last full block is seeded by the
  session;
- turn ``i > 0``: the previous prompt + the tokens the engine actually
  generated for it + the turn's new tokens (seeded by session and turn), sent
  ``delay_s * time_scale`` after the previous turn finished (closed loop, as
  an agent waits for its model). Output lengths are the trace's
  (``ignore_eos``), so only the token values of outputs depend on the engine.

A trace's ``block_size`` is only the granularity of prefix sharing here; the
engine hashes its own blocks. Small trace blocks keep shared layers exact.
"""

from __future__ import annotations

import hashlib
import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from vllm_ext.histate.traces import Trace, TraceRequest

TOKEN_LOW, TOKEN_HIGH = 100, 30000  # plain-vocabulary ids of the tiny models


def _seeded_tokens(seed_text: str, n: int) -> list[int]:
    seed = int.from_bytes(hashlib.blake2b(seed_text.encode(), digest_size=8).digest(), "little")
    return np.random.default_rng(seed).integers(TOKEN_LOW, TOKEN_HIGH, size=n).tolist()


def first_prompt(request: TraceRequest, block_size: int) -> list[int]:
    """Token ids of a session's first prompt (shared blocks give shared tokens)."""
    full = request.prompt_tokens // block_size
    tokens: list[int] = []
    for block_hash in request.blocks[:full]:
        tokens += _seeded_tokens(f"block/{block_hash}", block_size)
    tail = request.prompt_tokens - full * block_size
    return tokens + _seeded_tokens(f"{request.session_id}/tail0", tail)


def new_turn_tokens(request: TraceRequest) -> list[int]:
    """The new tokens (user message, tool result) turn ``request.turn > 0`` appends."""
    return _seeded_tokens(f"{request.session_id}/t{request.turn}/in", request.new_tokens)


@dataclass
class Session:
    """One session's turns and where it is in them."""

    turns: list[TraceRequest]
    next_turn: int = 0
    prompt: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Turn:
    """A request ready to send: ids, prompt, how many tokens to generate, when it became due."""

    request_id: str
    session_id: str
    turn: int
    prompt: list[int]
    max_tokens: int
    due_s: float


class ClosedLoopReplay:
    """Which turns are due when; feed it finished outputs, it schedules the next turns.

    Args:
        trace: the saved trace (sessions start at their first request's ``arrival_s``).
        time_scale: multiplies session starts and think/tool delays (compresses the trace).
        max_delay_s: cap on one delay after scaling.
        max_tokens_total: prompt + output cap (the engine's ``max_model_len``); a
            session ends before a turn that would exceed it.
    """

    def __init__(
        self,
        trace: Trace,
        time_scale: float = 1.0,
        max_delay_s: float = 30.0,
        max_tokens_total: int | None = None,
    ) -> None:
        if time_scale <= 0:
            raise ValueError(f"time_scale must be > 0, got {time_scale}")
        self.block_size = trace.block_size
        self.time_scale = time_scale
        self.max_delay_s = max_delay_s
        self.max_tokens_total = max_tokens_total
        by_session: dict[str, list[TraceRequest]] = {}
        for request in trace.requests:
            by_session.setdefault(request.session_id, []).append(request)
        self.sessions = {
            sid: Session(sorted(turns, key=lambda r: r.turn)) for sid, turns in by_session.items()
        }
        self._due: list[tuple[float, str]] = []
        for sid, session in self.sessions.items():
            heapq.heappush(self._due, (session.turns[0].arrival_s * time_scale, sid))
        self.skipped_turns = 0

    def pending(self) -> int:
        """Turns waiting for their time (sent but unfinished ones are the caller's)."""
        return len(self._due)

    def next_due_s(self) -> float | None:
        return self._due[0][0] if self._due else None

    def pop_due(self, now_s: float) -> list[Turn]:
        """Every turn due at or before ``now_s``, ready to send."""
        out = []
        while self._due and self._due[0][0] <= now_s:
            due, sid = heapq.heappop(self._due)
            session = self.sessions[sid]
            request = session.turns[session.next_turn]
            if session.next_turn == 0:
                session.prompt = first_prompt(request, self.block_size)
            else:
                session.prompt = session.prompt + new_turn_tokens(request)
            limit = self.max_tokens_total
            if limit is not None and len(session.prompt) + request.output_tokens > limit:
                self.skipped_turns += len(session.turns) - session.next_turn
                continue
            out.append(
                Turn(
                    f"{sid}/t{request.turn}",
                    sid,
                    request.turn,
                    list(session.prompt),
                    request.output_tokens,
                    due,
                )
            )
        return out

    def finished(self, turn: Turn, output_ids: Sequence[int], now_s: float) -> None:
        """``turn`` finished at ``now_s`` with ``output_ids``: schedule the session's next turn."""
        session = self.sessions[turn.session_id]
        session.prompt = session.prompt + list(output_ids)
        session.next_turn += 1
        if session.next_turn < len(session.turns):
            delay = session.turns[session.next_turn].delay_s * self.time_scale
            heapq.heappush(self._due, (now_s + min(delay, self.max_delay_s), turn.session_id))
