"""A separate, smaller model as the source: any model with the target's tokenizer (no vLLM).

The source runs its first ``source_layer`` layers over the whole prefix; that
hidden state (RMS-normalised) feeds one converter per target layer — every
target layer is converted, none is exact. The sink tokens and an optional
exact tail go through every target layer, as in :class:`AcctPipeline`, so the
converted KV still sits next to the target's own KV of the attention sinks.

This is the form the speed target asks for (a source of a fraction of the
target's compute: a small member of the target's family). No such pair is
installable offline, so it is tested on random tiny pairs only; the checkpoint
format, the trainer and the connector use the first-k-layers source.
"""

from __future__ import annotations

import math

import torch

from vllm_ext.acct.converter import Converters, RidgeAccumulator
from vllm_ext.acct.llama import LlamaShape, TorchLlama
from vllm_ext.acct.pipeline import AcctPipeline, SourceState


def layer_weights(shape: LlamaShape) -> int:
    """Multiply-adds per token of one decoder layer's projections (attention's n^2 excluded)."""
    h = shape.hidden_size
    attention = 2 * h * shape.num_heads * shape.head_dim + 2 * h * shape.kv_width
    return attention + 3 * h * shape.intermediate_size


class ModelSourcePipeline(AcctPipeline):
    """Small source model + converters for every target layer + exact sinks (and tail)."""

    def __init__(
        self,
        target: TorchLlama,
        source: TorchLlama,
        converters: Converters,
        sink_tokens: int = 4,
        tail_tokens: int = 0,
        source_layer: int | None = None,
    ):
        if source.shape.vocab_size != target.shape.vocab_size:
            raise ValueError(
                f"the source's vocabulary ({source.shape.vocab_size} tokens) is not the "
                f"target's ({target.shape.vocab_size}): a source must share the tokenizer"
            )
        layer = source.shape.num_layers if source_layer is None else source_layer
        if not 0 <= layer <= source.shape.num_layers:
            raise ValueError(f"source_layer {layer} outside 0..{source.shape.num_layers}")
        if converters.first_layer != 0 or converters.feature_size != source.shape.hidden_size:
            raise ValueError(
                "a separate source needs converters for every target layer (first_layer 0, "
                f"got {converters.first_layer}) fed by its hidden size "
                f"{source.shape.hidden_size} (got {converters.feature_size})"
            )
        super().__init__(target, converters, sink_tokens, tail_tokens)
        self.source = source
        self.source_layer = layer

    def source_cost_layer_tokens(self, n: int) -> int:
        """The source's work over ``n`` tokens in target layer-token units (projections only)."""
        ratio = layer_weights(self.source.shape) / layer_weights(self.target.shape)
        return math.ceil(self.source_layer * n * ratio)

    def cost_layer_tokens(self, n: int) -> int:
        return self.source_cost_layer_tokens(n) + super().cost_layer_tokens(n)

    def source_features(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos_sin = self.source.cos_sin(positions)
        hidden = self.source.embed(ids)
        for i in range(self.source_layer):
            hidden = self.source.layer(i, hidden, cos_sin, None).hidden
        return self.converters.features(hidden)

    def run_source(self, ids: torch.Tensor, positions: torch.Tensor | None = None) -> SourceState:
        target = self.target
        if positions is None:
            positions = torch.arange(ids.shape[0], device=ids.device)
        features = self.source_features(ids, positions)
        cos_sin = target.cos_sin(positions)
        s, tail = self._split(ids.shape[0])
        sink_hidden, sink_cs = target.embed(ids[:s]), (cos_sin[0][:s], cos_sin[1][:s])
        sinks = {}
        for j in range(self.num_layers):
            out = target.layer(j, sink_hidden, sink_cs, None)
            sink_hidden = out.hidden
            sinks[j] = out.kv
        return SourceState(positions, cos_sin, [], sinks, features, target.embed(ids[tail:]), tail)


@torch.no_grad()
def ridge_fit(pipeline: ModelSourcePipeline, contexts: list[torch.Tensor], alpha: float) -> int:
    """Least-squares converters on the target's own pre-RoPE K and V; returns rows used."""
    target, acc = pipeline.target, RidgeAccumulator(pipeline.converters)
    s = pipeline.sink_tokens
    for ids in contexts:
        positions = torch.arange(ids.shape[0])
        features = pipeline.source_features(ids, positions)
        cos_sin, hidden, targets = target.cos_sin(positions), target.embed(ids), {}
        for j in range(pipeline.num_layers):
            out = target.layer(j, hidden, cos_sin, None, keep_pre_rope=True)
            hidden = out.hidden
            # the sink tokens are computed exactly and carry outlier activations: not fitted
            targets[j] = (out.pre_rope_key[:, s:], out.kv[1][:, s:])
        acc.add(features[s:], targets)
    acc.solve(alpha)
    return acc.rows
