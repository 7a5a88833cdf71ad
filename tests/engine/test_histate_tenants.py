"""HiState never serves one tenant's cached state to another (real engine, tiny hybrid, CPU).

vLLM isolates tenants' prefix caches with a per-request ``cache_salt``: it enters the hash
of a prompt's first block, so every block hash after it differs too. HiState keys its KV
blocks and snapshots by those hashes, so a salted request can only hit what was stored
under the same salt. Each test clears vLLM's device cache first, so any hit is HiState's;
the repeat under the stored salt must hit, so the isolation checks cannot pass vacuously.
"""

from __future__ import annotations

import pytest

from tests.engine.test_histate_engine import (
    BLOCK,
    MODEL,
    _params,
    _tokens,
    histate_kwargs,
    scheduler_of,
)
from tests.helpers import engine

PROMPT = _tokens(31, 2 * BLOCK + 20)  # two full blocks: a hit is 768 tokens


@pytest.fixture(scope="module")
def histate(tmp_path_factory):
    directory = tmp_path_factory.mktemp("histate-tenants")
    with engine(MODEL, **histate_kwargs(directory=str(directory), host_bytes=256 << 20)) as llm:
        conn = scheduler_of(llm).connector
        yield llm, conn
        conn.shutdown()
    del llm


def _serve(llm, conn, salt: str | None) -> tuple[list[int], float]:
    """Greedy tokens of PROMPT under ``salt`` after clearing vLLM's device cache; HiState hit."""
    conn.runtime.drain()
    llm.reset_prefix_cache()
    prompt = {"prompt_token_ids": PROMPT}
    if salt is not None:
        prompt["cache_salt"] = salt
    before = conn.counters.value("hit_tokens")
    out = llm.generate([prompt], _params(), use_tqdm=False)[0]
    return list(out.outputs[0].token_ids), conn.counters.value("hit_tokens") - before


def test_requests_with_another_cache_salt_never_share_a_hit(histate):
    llm, conn = histate
    cold, hit = _serve(llm, conn, "tenant-a")
    assert hit == 0
    stored = conn.counters.value("snapshots_stored")
    assert stored > 0  # tenant a's state at 768 tokens is in HiState now
    # the same tokens under another salt, and unsalted: misses, and the cold tokens
    assert _serve(llm, conn, "tenant-b") == (cold, 0)
    assert _serve(llm, conn, None) == (cold, 0)
    # each tenant hits its own entry: the isolation above is not an absence of hits
    assert _serve(llm, conn, "tenant-a") == (cold, 2 * BLOCK)
    assert _serve(llm, conn, "tenant-b") == (cold, 2 * BLOCK)
    assert _serve(llm, conn, None) == (cold, 2 * BLOCK)


def test_salts_that_differ_by_one_character_do_not_share(histate):
    llm, conn = histate
    _serve(llm, conn, "acme-01")
    assert _serve(llm, conn, "acme-02")[1] == 0
    assert _serve(llm, conn, "acme-01")[1] == 2 * BLOCK
