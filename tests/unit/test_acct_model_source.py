"""A separate small source model on random tiny Llama pairs sharing a vocabulary (no vLLM)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from vllm_ext.acct.converter import Converters
from vllm_ext.acct.llama import LlamaShape, TorchLlama
from vllm_ext.acct.model_source import ModelSourcePipeline, layer_weights, ridge_fit
from vllm_ext.acct.pipeline import own_prefill

torch.set_num_threads(1)
VOCAB = 97


def _shape(rng, layers: int, hidden: int) -> LlamaShape:
    kv_heads = int(rng.choice([1, 2]))
    return LlamaShape(
        hidden_size=hidden,
        num_layers=layers,
        num_heads=kv_heads * int(rng.choice([1, 2])),
        num_kv_heads=kv_heads,
        head_dim=int(rng.choice([8, 16])),
        intermediate_size=int(rng.choice([32, 64])),
        vocab_size=VOCAB,
        rope_theta=float(rng.choice([1e4, 1e5])),
        rms_norm_eps=1e-5,
        tie_word_embeddings=bool(rng.integers(2)),
    )


def _random_model(shape: LlamaShape, seed: int) -> TorchLlama:
    torch.manual_seed(seed)
    model = TorchLlama(shape)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
            else:  # the RMSNorm weights
                p.uniform_(0.5, 1.5)
    return model.eval().requires_grad_(False)


@pytest.fixture(scope="module", params=[0, 1, 2])
def pair(request):
    rng = np.random.default_rng(request.param)
    wide = dataclasses.replace(_shape(rng, int(rng.integers(2, 5)), 48), intermediate_size=96)
    target = _random_model(wide, request.param)
    source = _random_model(_shape(rng, int(rng.integers(1, 3)), 32), 100 + request.param)
    return target, source


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def _noisy_converters(target: TorchLlama, source: TorchLlama) -> Converters:
    converters = Converters(target.shape, 0, source.shape.hidden_size)
    for linear in converters.proj:
        torch.nn.init.normal_(linear.weight, std=0.3)
    return converters


def test_sinks_are_the_targets_own_kv_every_other_token_is_converted(pair):
    target, source = pair
    pipeline = ModelSourcePipeline(target, source, _noisy_converters(target, source), 3)
    ids = _ids(25, seed=1)
    with torch.no_grad():
        imported, own = pipeline.build_cache(ids), own_prefill(target, ids)
    shape = target.shape
    for (k1, v1), (k2, v2) in zip(imported, own, strict=True):
        assert k1.shape == k2.shape == (shape.num_kv_heads, 25, shape.head_dim)
        torch.testing.assert_close(k1[:, :3], k2[:, :3], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v1[:, :3], v2[:, :3], atol=1e-5, rtol=1e-5)
        assert not torch.allclose(v1[:, 3:], v2[:, 3:], atol=1e-3)


def test_a_tail_over_every_non_sink_token_is_the_targets_own_kv(pair):
    target, source = pair
    converters = _noisy_converters(target, source)
    ids = _ids(30, seed=2)
    with torch.no_grad():
        whole = ModelSourcePipeline(target, source, converters, 3, tail_tokens=27)
        for (k1, v1), (k2, v2) in zip(
            whole.build_cache(ids), own_prefill(target, ids), strict=True
        ):
            torch.testing.assert_close(k1, k2, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(v1, v2, atol=1e-5, rtol=1e-5)


def test_ridge_recovers_the_first_target_layer_from_shared_embeddings(pair):
    # a source that is the target's embedding table: target layer 0's pre-RoPE K and V are
    # linear in the RMS-normalised embeddings, so ridge must find them exactly
    target, _ = pair
    pipeline = ModelSourcePipeline(target, target, Converters(target.shape, 0), 2, source_layer=0)
    ridge_fit(pipeline, [_ids(60, s) for s in range(3)], alpha=1e-9)
    ids = _ids(40, seed=9)
    with torch.no_grad():
        (k1, v1), (k2, v2) = pipeline.build_cache(ids)[0], own_prefill(target, ids)[0]
    torch.testing.assert_close(k1, k2, atol=2e-3, rtol=1e-3)
    torch.testing.assert_close(v1, v2, atol=2e-3, rtol=1e-3)


def _first_layers_copy(target: TorchLlama, layers: int) -> TorchLlama:
    """The target's first ``layers`` layers as a separate model (a "pruned family member")."""
    copy = TorchLlama(dataclasses.replace(target.shape, num_layers=layers))
    copy.load_state_dict(target.state_dict(), strict=False)
    return copy.eval().requires_grad_(False)


def test_ridge_recovers_the_layer_after_a_pruned_copy_of_the_target(pair):
    # the source is a separate model holding the target's first L-1 layers: target layer L-1's
    # pre-RoPE K and V are linear in its RMS-normalised output, so ridge must find them
    target, _ = pair
    last = target.shape.num_layers - 1
    source = _first_layers_copy(target, last)
    pipeline = ModelSourcePipeline(target, source, Converters(target.shape, 0), 2)
    rows = ridge_fit(pipeline, [_ids(60, s) for s in range(3)], alpha=1e-9)
    assert rows == 3 * (60 - 2)
    ids = _ids(40, seed=9)
    with torch.no_grad():
        (k1, v1), (k2, v2) = pipeline.build_cache(ids)[last], own_prefill(target, ids)[last]
    torch.testing.assert_close(k1, k2, atol=2e-3, rtol=1e-3)
    torch.testing.assert_close(v1, v2, atol=2e-3, rtol=1e-3)


def test_cost_counts_the_source_at_its_relative_size(pair):
    target, source = pair
    pipeline = ModelSourcePipeline(target, source, Converters(target.shape, 0, 32), 4, 6)
    ratio = layer_weights(source.shape) / layer_weights(target.shape)
    expected = math.ceil(source.shape.num_layers * 100 * ratio) + target.shape.num_layers * 10
    assert ratio < 1 and pipeline.cost_layer_tokens(100) == expected


def test_mismatched_sources_are_refused(pair):
    target, source = pair
    other = _random_model(LlamaShape(**{**source.shape.__dict__, "vocab_size": VOCAB + 1}), seed=5)
    with pytest.raises(ValueError, match="vocabulary"):
        ModelSourcePipeline(target, other, Converters(target.shape, 0, 32))
    with pytest.raises(ValueError, match="first_layer 0"):
        ModelSourcePipeline(target, source, Converters(target.shape, 1, 32))
    with pytest.raises(ValueError, match="hidden size 32"):
        ModelSourcePipeline(target, source, Converters(target.shape, 0, 48))
    with pytest.raises(ValueError, match="source_layer 9"):
        ModelSourcePipeline(target, source, Converters(target.shape, 0, 32), source_layer=9)
