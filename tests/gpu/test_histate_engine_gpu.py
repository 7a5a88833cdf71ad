"""On a GPU: a prefix HiState stored, evicted from the device and loaded back decodes alike.

The CUDA twin of tests/engine/test_histate_engine.py (CPU, in CI): the same tiny hybrid and
connector with the KV cache on the GPU, so stores and loads go through pinned host copies on
the side stream. Prompts are sized from the block size the engine chose (it depends on the
platform's attention page), each run cold first, then again after vLLM's device cache is reset.
"""

from __future__ import annotations

import pytest

from tests.engine.test_histate_engine import MODEL, _run, _tokens, histate_kwargs, scheduler_of
from tests.helpers import engine


def check_restores_exactly(llm) -> None:
    """Cold run, device cache reset, run again: the same greedy tokens, served by HiState."""
    conn = scheduler_of(llm).connector
    block = conn.block_size
    for seed, n in ((1, 2 * block), (2, 2 * block + 1), (3, 3 * block + block // 2)):
        prompt = _tokens(seed, n)
        cold = list(_run(llm, prompt).outputs[0].token_ids)
        conn.runtime.drain()
        llm.reset_prefix_cache()
        hits, loaded = conn.counters.value("hit_tokens"), conn.counters.value("kv_blocks_loaded")
        restored = list(_run(llm, prompt).outputs[0].token_ids)
        assert restored == cold, (n, block)
        # the deepest boundary before the last prompt token, KV and state from the host tier
        assert conn.counters.value("hit_tokens") - hits == (n - 1) // block * block, (n, block)
        assert conn.counters.value("kv_blocks_loaded") > loaded
    assert conn.counters.value("snapshots_loaded_host") >= 3


def test_restored_prefix_decodes_the_cold_tokens_on_cuda(tmp_path):
    pytest.importorskip("vllm")
    with engine(MODEL, **histate_kwargs(directory=str(tmp_path), host_bytes=256 << 20)) as llm:
        check_restores_exactly(llm)
        scheduler_of(llm).connector.shutdown()
    del llm
