"""OpenAI-client load driver for a running ``vllm serve``.

:func:`run_trace` sends every :class:`Request` at its arrival offset, streams
the completion (chat when ``messages`` is set, legacy completions when
``prompt`` is set) with ``stream_options={"include_usage": True}``, and
returns one :class:`RequestRecord` per request in input order. A failing
request is recorded with ``ok=False`` and never aborts the run. The openai
client and tqdm are imported lazily.

Why this driver rather than ``vllm bench serve``: every variant of a benchmark,
plain vLLM included, must get the very same requests and arrival times, each
request with its own extras (LEAP's length hints), and each request's record is
kept for the benchmark's own metrics.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Request:
    """One request of a trace; exactly one of ``messages``/``prompt``."""

    id: str
    messages: Sequence[Mapping[str, Any]] | None = None
    prompt: str | None = None
    max_tokens: int = 128
    arrival_s: float = 0.0
    temperature: float = 0.0
    extra_body: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        """Reject requests without exactly one input or with negative arrival."""
        if (self.messages is None) == (self.prompt is None):
            raise ValueError(f"request {self.id}: set exactly one of messages/prompt")
        if self.arrival_s < 0:
            raise ValueError(f"request {self.id}: arrival_s must be >= 0")


@dataclasses.dataclass
class RequestRecord:
    """Outcome of one request; times in seconds relative to the trace start."""

    id: str
    ok: bool
    error: str | None = None
    ttft_s: float | None = None
    latency_s: float | None = None
    output_tokens: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    itl_s: list[float] | None = None
    start_s: float | None = None
    end_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict form (JSON-serialisable)."""
        return dataclasses.asdict(self)


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    """``n`` arrival offsets (s) of a Poisson process of ``rate`` req/s.

    The first request arrives at 0; ``rate=inf`` puts every arrival at 0.
    The same ``seed`` always gives the same offsets.
    """
    if n < 0:
        raise ValueError("n must be >= 0")
    if not rate > 0:
        raise ValueError("rate must be > 0 (use math.inf for a burst)")
    if math.isinf(rate) or n == 0:
        return [0.0] * n
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=n - 1)
    return [0.0] + np.cumsum(gaps).tolist()


def assign_arrivals(requests: Sequence[Request], arrivals: Sequence[float]) -> list[Request]:
    """Copies of ``requests`` with ``arrival_s`` taken from ``arrivals``."""
    if len(requests) != len(arrivals):
        raise ValueError("requests and arrivals differ in length")
    return [
        dataclasses.replace(r, arrival_s=float(a)) for r, a in zip(requests, arrivals, strict=True)
    ]


def _normalize_base_url(base_url: str) -> str:
    """Append ``/v1`` to a bare ``http://host:port`` URL."""
    url = base_url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def make_client(base_url: str, timeout_s: float = 600.0) -> Any:
    """``openai.AsyncOpenAI`` for a vLLM server (api_key "EMPTY", no retries)."""
    import openai  # lazy: slow import

    return openai.AsyncOpenAI(
        base_url=_normalize_base_url(base_url), api_key="EMPTY", timeout=timeout_s, max_retries=0
    )


async def _open_stream(client: Any, model: str, req: Request) -> Any:
    """Start a streaming chat or completions call for ``req``."""
    common: dict[str, Any] = {
        "model": model,
        "max_tokens": req.max_tokens,
        "temperature": req.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
        "extra_body": dict(req.extra_body) or None,
    }
    if req.messages is not None:
        return await client.chat.completions.create(
            messages=[dict(m) for m in req.messages], **common
        )
    return await client.completions.create(prompt=req.prompt, **common)


def _chunk_text(chunk: Any) -> str:
    """Generated text carried by one stream chunk (chat or completions)."""
    choices = getattr(chunk, "choices", None) or []
    if not choices:
        return ""
    choice = choices[0]
    delta = getattr(choice, "delta", None)
    if delta is not None:
        return getattr(delta, "content", None) or getattr(delta, "reasoning_content", None) or ""
    return getattr(choice, "text", None) or ""


def _apply_usage(rec: RequestRecord, usage: Any) -> None:
    """Copy token counts from an OpenAI ``usage`` object into ``rec``."""
    if usage.completion_tokens is not None:
        rec.output_tokens = int(usage.completion_tokens)
    rec.prompt_tokens = usage.prompt_tokens
    details = getattr(usage, "prompt_tokens_details", None)
    cached = getattr(details, "cached_tokens", None) if details else None
    rec.cached_tokens = int(cached) if cached is not None else None


async def _send(
    client: Any, model: str, req: Request, t0: float, record_itl: bool
) -> RequestRecord:
    """Send one request, stream its output and measure it."""
    start = time.perf_counter()
    rec = RequestRecord(id=req.id, ok=True, start_s=start - t0)
    token_times: list[float] = []
    content_chunks, got_usage = 0, False
    try:
        stream = await _open_stream(client, model, req)
        async for chunk in stream:
            if _chunk_text(chunk):
                token_times.append(time.perf_counter())
                content_chunks += 1
            if getattr(chunk, "usage", None) is not None:
                _apply_usage(rec, chunk.usage)
                got_usage = True
    except Exception as exc:  # noqa: BLE001 - recorded, never aborts the run
        rec.ok, rec.error = False, f"{type(exc).__name__}: {exc}"
        logger.debug("request %s failed: %s", req.id, rec.error)
    end = time.perf_counter()
    rec.end_s, rec.latency_s = end - t0, end - start
    if token_times:
        rec.ttft_s = token_times[0] - start
        if record_itl:
            rec.itl_s = np.diff(token_times).tolist()
    if not got_usage:
        rec.output_tokens = content_chunks
    return rec


async def run_trace(
    base_url: str,
    model: str,
    requests: Sequence[Request],
    *,
    max_concurrency: int | None = None,
    progress: bool = True,
    desc: str = "requests",
    timeout_s: float = 600.0,
    record_itl: bool = True,
    client: Any | None = None,
) -> list[RequestRecord]:
    """Replay ``requests`` against ``base_url`` and return their records.

    Each request is launched at its ``arrival_s`` offset from the start of
    the run (at most ``max_concurrency`` in flight when set). ``client``
    overrides the ``openai.AsyncOpenAI`` built from ``base_url``.
    """
    from tqdm.auto import tqdm  # lazy

    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError("max_concurrency must be >= 1")
    own_client = client is None
    client = make_client(base_url, timeout_s) if own_client else client
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(requests), desc=desc, disable=not progress, unit="req")
    t0 = time.perf_counter()

    async def launch(req: Request) -> RequestRecord:
        """Wait for the arrival offset, then send (under the semaphore)."""
        await asyncio.sleep(max(0.0, t0 + req.arrival_s - time.perf_counter()))
        if sem is None:
            rec = await _send(client, model, req, t0, record_itl)
        else:
            async with sem:
                rec = await _send(client, model, req, t0, record_itl)
        bar.update(1)
        return rec

    try:
        records = await asyncio.gather(*(launch(r) for r in requests))
    finally:
        bar.close()
        if own_client:
            await client.close()
    failed = sum(not r.ok for r in records)
    if failed:
        logger.warning(
            "%d of %d requests failed (first: %s)",
            failed,
            len(records),
            next(r.error for r in records if not r.ok),
        )
    return list(records)


def run_trace_sync(
    base_url: str, model: str, requests: Sequence[Request], **kwargs: Any
) -> list[RequestRecord]:
    """Blocking wrapper: ``asyncio.run(run_trace(...))``."""
    return asyncio.run(run_trace(base_url, model, requests, **kwargs))
