"""Build the target's KV cache for a prefix from a cheap source (no vLLM).

Source = the target's own first ``k`` layers (exact for them). Their output
feeds the converters of layers ``k..L-1``. The first ``sink_tokens`` tokens
(attention sinks, which dominate the converter error: acct.md §3) go through
the remaining layers exactly, starting from the same hidden state; by
causality that is the target's own KV for those positions. ``k = L`` (no
converters) is the identity import: the target's own KV, bit for bit.

Optionally the last ``tail_tokens`` tokens also go through layers ``k..L-1``
of the target itself, attending to the converted cache of the tokens before
them: the recent context, which matters most to the next tokens, is then the
target's own computation over an approximate past.

Cost of one import of ``n`` tokens, in target layer-token units:
``k * n + (L - k) * (sink_tokens + tail_tokens)`` plus the converters.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from vllm_ext.acct.converter import Converters
from vllm_ext.acct.llama import KV, TorchLlama, concat_kv


@dataclass
class SourceState:
    """What the source computed for a prefix, before any converter runs."""

    positions: torch.Tensor
    cos_sin: tuple[torch.Tensor, torch.Tensor]
    exact: list[KV]  # layers 0..k-1, every token
    sinks: dict[int, KV]  # layers k..L-1, the first sink tokens
    features: torch.Tensor | None  # converter input for every token
    tail_hidden: torch.Tensor | None = None  # the tail's hidden state entering the next layer
    tail_start: int = 0


class AcctPipeline:
    """Source runner + converters + exact sinks for one target model."""

    def __init__(
        self,
        target: TorchLlama,
        converters: Converters | None,
        sink_tokens: int = 4,
        tail_tokens: int = 0,
    ):
        if sink_tokens < 0 or tail_tokens < 0:
            raise ValueError(f"sink_tokens ({sink_tokens}) and tail_tokens ({tail_tokens}) < 0")
        self.target = target
        self.converters = converters
        self.num_layers = target.shape.num_layers
        self.source_layers = self.num_layers if converters is None else converters.first_layer
        self.sink_tokens = 0 if converters is None else sink_tokens
        self.tail_tokens = 0 if converters is None else tail_tokens

    @property
    def is_identity(self) -> bool:
        return self.converters is None

    def _split(self, n: int) -> tuple[int, int]:
        """(sink tokens, first tail token) for a prefix of ``n`` tokens."""
        s = min(self.sink_tokens, n)
        return s, max(s, n - self.tail_tokens)

    def cost_layer_tokens(self, n: int) -> int:
        """Target layer-token units one import of ``n`` tokens costs (converters excluded)."""
        s, tail = self._split(n)
        return self.source_layers * n + (self.num_layers - self.source_layers) * (s + n - tail)

    def run_source(self, ids: torch.Tensor, positions: torch.Tensor | None = None) -> SourceState:
        target = self.target
        if positions is None:
            positions = torch.arange(ids.shape[0], device=ids.device)
        cos_sin = target.cos_sin(positions)
        hidden = target.embed(ids)
        exact: list[KV] = []
        for i in range(self.source_layers):
            out = target.layer(i, hidden, cos_sin, None)
            hidden = out.hidden
            exact.append(out.kv)
        sinks: dict[int, KV] = {}
        features = None
        s, tail = self._split(ids.shape[0])
        if self.converters is not None:
            sink_hidden = hidden[:s]
            sink_cs = (cos_sin[0][:s], cos_sin[1][:s])
            for j in range(self.source_layers, self.num_layers):
                out = target.layer(j, sink_hidden, sink_cs, None)
                sink_hidden = out.hidden
                sinks[j] = out.kv
            features = self.converters.features(hidden)
        return SourceState(positions, cos_sin, exact, sinks, features, hidden[tail:], tail)

    def convert_layer(self, state: SourceState, layer: int) -> KV:
        """The imported KV of target ``layer`` for every token of the prefix.

        With a tail, call it for layers in order: the tail's hidden state moves one layer on.
        """
        if layer < self.source_layers:
            return state.exact[layer]
        cos, sin = state.cos_sin
        s, tail = state.sinks[layer][0].shape[1], state.tail_start
        rest = self.converters.convert(layer, state.features[s:tail], (cos[s:tail], sin[s:tail]))
        rest = rest[0].to(self.target.dtype), rest[1].to(self.target.dtype)
        kv = concat_kv(state.sinks[layer], rest) if s else rest
        if state.tail_hidden is None or state.tail_hidden.shape[0] == 0:
            return kv
        # the last tokens through the target's own layer, over the imported past
        out = self.target.layer(layer, state.tail_hidden, (cos[tail:], sin[tail:]), kv)
        state.tail_hidden = out.hidden
        return concat_kv(kv, out.kv)

    def layers(self, state: SourceState) -> Iterator[tuple[int, KV]]:
        for layer in range(self.num_layers):
            yield layer, self.convert_layer(state, layer)

    def build_cache(self, ids: torch.Tensor) -> list[KV]:
        """The imported KV of every target layer for ``ids`` (positions ``0..n-1``)."""
        state = self.run_source(ids)
        return [kv for _, kv in self.layers(state)]


def own_prefill(target: TorchLlama, ids: torch.Tensor) -> list[KV]:
    """The target's own KV for ``ids`` (positions ``0..n-1``)."""
    _, cache = target.forward_with_cache(ids, torch.arange(ids.shape[0], device=ids.device))
    return cache


def continuation_logits(
    target: TorchLlama, cache: list[KV], ids: torch.Tensor, start: int | None = None
) -> torch.Tensor:
    """Target logits of ``ids`` placed right after ``cache`` (positions from ``start``)."""
    start = cache[0][0].shape[1] if start is None else start
    positions = torch.arange(start, start + ids.shape[0], device=ids.device)
    logits, _ = target.forward_with_cache(ids, positions, cache)
    return logits
