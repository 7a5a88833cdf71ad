"""HiState on the other page layout of the tiny hybrid: float32 recurrent state.

The HiState engine tests pin bf16 SSM state (384-token blocks). vLLM picks
float32 state on CPUs with AVX-512-BF16, and the larger state page raises the
hybrid block to 640 tokens; this checks that HiState restores exactly there too,
counting in whatever block size the engine chose, and that the connector says at start-up
which block size and tiers it runs with (a user must not have to guess why nothing hits).
"""

from __future__ import annotations

import logging

from tests.engine.test_histate_engine import (
    IDLE,
    MODEL,
    _run,
    _tokens,
    histate_kwargs,
    scheduler_of,
    settle,
)
from tests.helpers import engine


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def test_float32_state_layout_restores_the_cold_tokens():
    kwargs = {**histate_kwargs(host_bytes=64 << 20, ssd_bytes=0),
              "mamba_ssm_cache_dtype": "float32"}  # fmt: skip
    logger = logging.getLogger("vllm.vllm_ext.histate.connector")
    lines, level = _Lines(), logger.level
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)  # vLLM's default level; the test run may raise it
    try:
        with engine(MODEL, **kwargs) as llm:
            _check_float32_layout(llm)
        del llm
    finally:
        logger.removeHandler(lines)
        logger.setLevel(level)
    (started,) = [line for line in lines.lines if line.startswith("HiState: block size")]
    assert "block size 640 tokens" in started and "float32" in started
    assert "tiers: host 64 MiB, SSD off" in started


def _check_float32_layout(llm) -> None:
    conn = scheduler_of(llm).connector
    block = conn.block_size
    assert block == 640  # float32 state page: not the bf16 layout the other tests use
    prompt = _tokens(900, 2 * block + 1)
    cold = list(_run(llm, prompt).outputs[0].token_ids)  # a miss everywhere: computed
    conn.runtime.drain()
    llm.reset_prefix_cache()
    before = conn.counters.value("hit_tokens")
    again = list(_run(llm, prompt).outputs[0].token_ids)
    assert again == cold
    assert conn.counters.value("hit_tokens") - before == 2 * block
    assert conn.counters.value("snapshots_loaded_host") > 0
    conn.runtime.drain()
    settle(llm)
    assert conn.idle_state() == IDLE
    conn.shutdown()
