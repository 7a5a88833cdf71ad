"""HiState tails in a real vLLM engine: the state at a request's exact end (tiny hybrid, CPU).

vLLM's align mode keeps recurrent state only at block boundaries (384 tokens
here), so the next turn of a conversation recomputes everything after the last
boundary and a conversation shorter than a block never hits. HiState keeps the
state at each request's exact end with the KV of its partial last block (a
*tail*): the next turn -- previous prompt + previous output + new message --
recomputes only its new tokens (and the last token of the previous turn, whose
state vLLM never computed), also below one block.

Cases are drawn at random (prompt, output and new-message lengths, so cut
points fall anywhere inside a block), seeded per run; the seed is printed and
``VLLMEXT_TEST_SEED`` replays it.

Exactness: the random tiny model's next-token distribution barely depends on
the recurrent state (an off-by-one state moves its logprobs by one bf16 ulp),
so greedy tokens alone cannot tell a right state from a wrong one. The state
test compares the bytes: the tail taken after decoding equals, up to bf16
rounding, the state a cold prefill of exactly the same tokens leaves, and is
much further from the state one token earlier. Greedy tokens of the restored
turn are compared with a cold run up to the cold run's first near-tie.
"""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

from tests.engine.test_histate_engine import counter, histate_kwargs, scheduler_of, settle
from tests.engine.test_histate_engine import worker_of as histate_worker
from tests.helpers import engine
from vllm_ext.histate.policy import tail_snap_key

MODEL = "tiny-hybrid"
SEED = int(os.environ.get("VLLMEXT_TEST_SEED", random.randrange(1 << 30)))
NEAR_TIE = 0.02  # logprob margin within bf16 noise (1 ulp at these logits is 0.0078)


def _tokens(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(100, 30000, size=n).tolist()


def _cases(n: int) -> list[tuple[int, int, int]]:
    """(prompt, output, new-message) lengths: inside the first block, across blocks, long."""
    rng = np.random.default_rng(SEED)
    out = [(int(rng.integers(5, 300)), int(rng.integers(1, 60)), int(rng.integers(1, 60)))]
    for _ in range(n - 1):
        out.append((int(rng.integers(20, 1300)), int(rng.integers(1, 120)),
                    int(rng.integers(1, 300))))  # fmt: skip
    return out


def _generate(llm, prompt, n: int, salt: str | None = None, logprobs: int | None = None):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=logprobs)
    request = {"prompt_token_ids": prompt, **({"cache_salt": salt} if salt else {})}
    return llm.generate([request], params, use_tqdm=False)[0].outputs[0]


@pytest.fixture(scope="module")
def tails_engine():
    print(f"test_histate_tails: VLLMEXT_TEST_SEED={SEED}")
    with engine(MODEL, **histate_kwargs(host_bytes=256 << 20, ssd_bytes=0)) as llm:
        conn = scheduler_of(llm).connector
        assert conn.side._tail_extra is not None, "tails are on by default"
        yield llm, conn
    del llm


def _conversation(llm, rng, a: int, o: int, n: int, salt: str | None = None):
    """Turn 1 (``a`` prompt tokens, ``o`` output tokens); returns turn 2's prompt."""
    turn1 = _tokens(rng, a)
    out = list(_generate(llm, turn1, o, salt).token_ids)
    settle(llm)
    return turn1 + out + _tokens(rng, n)


def test_next_turn_recomputes_only_its_new_tokens(tails_engine):
    llm, conn = tails_engine
    rng = np.random.default_rng(SEED + 1)
    for i, (a, o, n) in enumerate(_cases(5)):
        turn2 = _conversation(llm, rng, a, o, n, salt=f"turn-{i}")
        llm.reset_prefix_cache()  # vLLM's own cache loses everything: HiState serves it
        before = counter(llm, "hit_tokens")
        _generate(llm, turn2, 4, salt=f"turn-{i}")
        settle(llm)
        # everything turn 1 computed comes back: its prompt and all but its last output
        # token (vLLM never fed that one); only the new message and that token are computed
        assert counter(llm, "hit_tokens") - before == a + o - 1, (SEED, a, o, n)
    assert conn.idle_state()["plans"] == 0


def test_a_conversation_inside_one_block_hits(tails_engine):
    """Align mode alone never hits below one block; a tail does."""
    llm, conn = tails_engine
    rng = np.random.default_rng(SEED + 2)
    a, o, n = int(rng.integers(5, 150)), int(rng.integers(2, 40)), int(rng.integers(1, 40))
    assert a + o + n < conn.block_size
    turn2 = _conversation(llm, rng, a, o, n, salt="small")
    llm.reset_prefix_cache()
    before = counter(llm, "hit_tokens")
    _generate(llm, turn2, 2, salt="small")
    assert counter(llm, "hit_tokens") - before == a + o - 1


def _new_tail_keys(llm, act) -> list[str]:
    worker = histate_worker(llm).store
    settle(llm)  # earlier requests' tails are not this one's
    before = worker.host_keys()
    act()
    settle(llm)
    return sorted(k for k in worker.host_keys() - before if k.startswith(tail_snap_key("")))


def _state(llm, key: str) -> torch.Tensor:
    # the page holds the conv and SSM states in bf16 (the test engine's state dtype)
    return histate_worker(llm).store._host[key].view(torch.bfloat16).float()


def _rel(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((x - y).norm() / y.norm())


def test_tail_state_equals_a_cold_prefill_of_the_same_tokens(tails_engine):
    llm, conn = tails_engine
    rng = np.random.default_rng(SEED + 3)
    for a, o, _ in _cases(3):
        prompt = _tokens(rng, a)
        tokens = []
        decoded = _new_tail_keys(
            llm, lambda t=tokens, p=prompt, n=o: t.extend(_generate(llm, p, n, "dec").token_ids)
        )
        end = a + o - 1  # the state after every token but the last sampled one
        if end % conn.block_size == 0:
            continue  # a boundary state, not a tail
        seq = (prompt + tokens)[:end]
        exact = _new_tail_keys(llm, lambda s=seq: _generate(llm, s, 1, "cold"))
        early = _new_tail_keys(llm, lambda s=seq: _generate(llm, s[:-1], 1, "early"))
        assert len(decoded) == len(exact) == len(early) == 1, (SEED, a, o)
        state = _state(llm, decoded[0])
        same, off_by_one = _rel(state, _state(llm, exact[0])), _rel(state, _state(llm, early[0]))
        # bf16 rounding of a different computation order vs one token of difference
        assert same < 0.05 and same < off_by_one / 4, (SEED, a, o, same, off_by_one)


def test_restored_turn_decodes_the_cold_runs_tokens(tails_engine):
    llm, conn = tails_engine
    rng = np.random.default_rng(SEED + 4)
    for i, (a, o, n) in enumerate(_cases(3)):
        turn2 = _conversation(llm, rng, a, o, n, salt=f"exact-{i}")
        cold = _generate(llm, turn2, 8, salt=f"cold-{i}", logprobs=2)
        llm.reset_prefix_cache()
        before = counter(llm, "hit_tokens")
        warm = _generate(llm, turn2, 8, salt=f"exact-{i}")
        assert counter(llm, "hit_tokens") - before == a + o - 1
        for pos, (token, top) in enumerate(zip(cold.token_ids, cold.logprobs, strict=True)):
            best = sorted((lp.logprob for lp in top.values()), reverse=True)
            if len(best) > 1 and best[0] - best[1] < NEAR_TIE:
                break  # a near-tie: bf16 rounding may pick either; later tokens differ
            assert warm.token_ids[pos] == token, (SEED, a, o, n, pos)
