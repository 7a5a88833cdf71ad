"""Prefill/decode request traces and the KV bytes they move (numpy, no vLLM).

A request arrives (Poisson), waits FCFS at the prefill instance that frees up
first, is prefilled, and its KV cache then moves to a decode instance drawn at
random (placement is not ARK's job; NetKV-style placement is complementary).
KV bytes = 2 (K and V) x layers x KV heads x head dim x dtype bytes x prompt
tokens. Queue and prefill times do not depend on the network, so a trace fixes
every transfer's start time and size before any port is chosen.

The defaults are assumptions, not measurements: a Llama-3.1-70B-shaped KV
(80 layers, 8 KV heads, head dim 128, bf16: 320 KiB per token), prefill at
30k tokens/s per instance plus 10 ms per batch (an 8-GPU node) with a small
quadratic attention term, prompts log-normal with median 3000 tokens
(long-context / agentic serving), clipped to [256, 32768].
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class KvGeometry:
    """Shape of one token's KV cache across all layers."""

    layers: int = 80
    kv_heads: int = 8
    head_dim: int = 128
    dtype_bytes: int = 2

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes


@dataclass(frozen=True)
class PrefillModel:
    """Seconds to prefill ``n`` tokens: ``fixed_s + n / tokens_per_s + quad_s * n**2``."""

    fixed_s: float = 0.010
    tokens_per_s: float = 30_000.0
    quad_s: float = 1.0e-10

    def seconds(self, tokens: np.ndarray) -> np.ndarray:
        tokens = np.asarray(tokens, dtype=float)
        return self.fixed_s + tokens / self.tokens_per_s + self.quad_s * tokens**2


@dataclass(frozen=True)
class PromptLengths:
    """Log-normal prompt lengths (tokens)."""

    median: float = 3000.0
    sigma: float = 0.8
    low: int = 256
    high: int = 32768

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        raw = rng.lognormal(np.log(self.median), self.sigma, n)
        return np.clip(np.rint(raw), self.low, self.high).astype(np.int64)


@dataclass(frozen=True)
class PdTrace:
    """One trace: per request its times, tokens, KV bytes and instances."""

    arrival: np.ndarray
    tokens: np.ndarray
    kv_bytes: np.ndarray
    prefill_host: np.ndarray
    decode_host: np.ndarray
    prefill_start: np.ndarray
    prefill_end: np.ndarray

    def __len__(self) -> int:
        return len(self.arrival)


def arrival_rate(utilization: float, n_prefill: int, lengths: PromptLengths,
                 model: PrefillModel, seed: int = 12345) -> float:  # fmt: skip
    """Requests/s that keep ``n_prefill`` instances busy ``utilization`` of the time."""
    sample = lengths.sample(np.random.default_rng(seed), 200_000)
    return utilization * n_prefill / float(model.seconds(sample).mean())


def pd_trace(
    n_requests: int,
    rate: float,
    n_prefill: int,
    n_decode: int,
    seed: int,
    geometry: KvGeometry = KvGeometry(),
    model: PrefillModel = PrefillModel(),
    lengths: PromptLengths = PromptLengths(),
) -> PdTrace:
    """Poisson arrivals at ``rate``/s over instances ``0..n_prefill-1`` and ``0..n_decode-1``."""
    if n_requests < 1 or rate <= 0 or n_prefill < 1 or n_decode < 1:
        raise ValueError("n_requests, rate, n_prefill and n_decode must be positive")
    rng = np.random.default_rng(seed)
    arrival = np.cumsum(rng.exponential(1.0 / rate, n_requests))
    tokens = lengths.sample(rng, n_requests)
    decode_host = rng.integers(0, n_decode, n_requests)
    service = model.seconds(tokens)
    free = [(0.0, host) for host in range(n_prefill)]  # (free at, host)
    heapq.heapify(free)
    prefill_host = np.empty(n_requests, dtype=np.int64)
    start = np.empty(n_requests)
    for i in range(n_requests):
        free_at, host = heapq.heappop(free)
        prefill_host[i] = host
        start[i] = max(free_at, arrival[i])
        heapq.heappush(free, (start[i] + service[i], host))
    return PdTrace(
        arrival=arrival,
        tokens=tokens,
        kv_bytes=tokens * geometry.bytes_per_token,
        prefill_host=prefill_host,
        decode_host=decode_host,
        prefill_start=start,
        prefill_end=start + service,
    )
