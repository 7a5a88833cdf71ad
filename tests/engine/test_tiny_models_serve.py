"""The tiny test models run in a real vLLM engine, and the hybrid one caches prefixes.

The hybrid (Gated DeltaNet + attention) needs vLLM's ``mamba_cache_mode="align"``
prefix caching: a hit needs attention KV *and* a recurrent-state snapshot at a
block boundary, so a repeated prefix longer than one block must report cached
tokens, and greedy tokens after the hit must equal a cold run's.
"""

from __future__ import annotations

import pytest

from tests.helpers import engine

PREFIX = list(range(1000, 2400))  # longer than two hybrid blocks (block size ≥ 384)


@pytest.fixture(scope="module")
def hybrid():
    with engine("tiny-hybrid", enable_prefix_caching=True, max_num_batched_tokens=2048) as llm:
        yield llm


def _greedy(max_tokens: int = 8):
    from vllm import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def test_hybrid_uses_align_mode_and_gdn_layers(hybrid):
    config = hybrid.llm_engine.vllm_config
    assert config.cache_config.mamba_cache_mode == "align"
    assert config.model_config.hf_config.layer_types.count("linear_attention") == 2


def test_hybrid_repeated_prefix_reports_cached_tokens(hybrid):
    cold = hybrid.generate([{"prompt_token_ids": PREFIX + [7, 8, 9]}], _greedy())[0]
    warm = hybrid.generate([{"prompt_token_ids": PREFIX + [7, 8, 9]}], _greedy())[0]
    other = hybrid.generate([{"prompt_token_ids": PREFIX + [11, 12]}], _greedy())[0]
    block = hybrid.llm_engine.vllm_config.cache_config.block_size
    assert (cold.num_cached_tokens or 0) == 0
    assert warm.num_cached_tokens >= block
    assert warm.num_cached_tokens % block == 0
    assert other.num_cached_tokens == warm.num_cached_tokens
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids


def test_hybrid_without_prefix_caching_matches_cached_run(hybrid):
    cached = hybrid.generate([{"prompt_token_ids": PREFIX + [3, 4]}], _greedy(12))[0]
    with engine("tiny-hybrid", enable_prefix_caching=False) as plain:
        cold = plain.generate([{"prompt_token_ids": PREFIX + [3, 4]}], _greedy(12))[0]
    assert cached.outputs[0].token_ids == cold.outputs[0].token_ids


def test_tiny_llama_generates_and_caches():
    with engine("tiny-llama", enable_prefix_caching=True) as llm:
        first = llm.generate([{"prompt_token_ids": PREFIX[:300]}], _greedy())[0]
        second = llm.generate([{"prompt_token_ids": PREFIX[:300]}], _greedy())[0]
    assert len(first.outputs[0].token_ids) == 8
    assert second.num_cached_tokens > 0
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
