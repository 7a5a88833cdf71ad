"""HiState inside a real vLLM engine (tiny Qwen3-Next hybrid: GDN + attention, bf16, CPU).

Exactness: a request whose prefix KV and recurrent state were restored from
HiState's host tier (vLLM's device cache reset, or evicted by other traffic)
decodes exactly the greedy tokens of a cold run without the connector --
prompts at a block boundary and one token either side, multi-chunk prefill, a
shared prefix with another suffix and a multi-turn conversation whose second
turn hits a state stored while the first turn decoded. Every exactness test
also checks that the hit was served by HiState, so none passes vacuously.
Then: aborts leave no pinned items, pending plans or blocks.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers import engine
from vllm_ext.common.config import config_block
from vllm_ext.histate.config import HiStateConfig
from vllm_ext.histate.policy import snap_key

MODEL = "tiny-hybrid"
BLOCK = 384  # tiny-hybrid's hybrid block size with prefix caching (vllm-surface 5.2)
# a small device pool (8 MiB ~ 20 blocks) so other traffic evicts a prefix; chunked prefill.
# bf16 SSM state pins the layout on every CPU: with AVX-512-BF16 vLLM otherwise switches
# the state to float32, whose larger page raises the hybrid block size to 640 tokens
ENGINE = dict(
    mamba_ssm_cache_dtype="bfloat16",
    enable_prefix_caching=True,
    max_num_batched_tokens=512,
    max_model_len=2048,
    kv_cache_memory_bytes=8 << 20,
)


def _tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(100, 30000, size=n).tolist()


SHARED = _tokens(99, 2 * BLOCK)
PROMPTS = {
    "boundary": _tokens(1, 2 * BLOCK),
    "boundary_minus_1": _tokens(2, 2 * BLOCK - 1),
    "boundary_plus_1": _tokens(3, 2 * BLOCK + 1),
    "multi_chunk": _tokens(4, 1300),
    "shared_a": SHARED + _tokens(5, 10),
    "shared_b": SHARED + _tokens(6, 50),
    "evicted": _tokens(7, 1000),
    "released": _tokens(10, 1000),
}
FILLERS = [_tokens(100 + i, 1000) for i in range(6)]
TURN1 = _tokens(8, 700)
TURN1_OUT = 80  # decoding crosses the boundary at 768 tokens
TURN2_NEW = _tokens(9, 100)


def _params(n: int = 8):
    from vllm import SamplingParams

    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def _run(llm, prompt, n: int = 8):
    return llm.generate([{"prompt_token_ids": prompt}], _params(n), use_tqdm=False)[0]


def histate_kwargs(**settings) -> dict:
    """Engine kwargs with the HiState connector (``settings``: HiStateConfig fields)."""
    return {
        **ENGINE,
        "kv_transfer_config": {
            "kv_connector": "HiStateConnector",
            "kv_connector_module_path": "vllm_ext.histate.connector",
            "kv_role": "kv_both",
        },
        "additional_config": {"histate": config_block(HiStateConfig, settings)},
    }


def scheduler_of(llm):
    return llm.llm_engine.engine_core.engine_core.scheduler


def worker_of(llm):
    """The worker half of the in-process engine's connector (it holds the bytes)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    worker = get_kv_transfer_group()
    assert worker is not scheduler_of(llm).connector and worker.store is not None
    return worker


def counter(llm, name: str) -> float:
    """A HiState counter over both halves (SSD I/O is counted where it happens: the worker)."""
    return scheduler_of(llm).connector.counters.value(name) + worker_of(llm).counters.value(name)


IDLE = {"requests": 0, "plans": 0, "loads": 0, "inflight": 0, "staging": 0, "hits_waiting": 0}


def settle(llm) -> None:
    """Step until finished requests' tails are copied and their blocks freed, as a served
    engine's loop does (``LLM.generate`` returns before that step), then wait for SSD work."""
    scheduler = scheduler_of(llm)
    while scheduler.has_requests():
        llm.llm_engine.step()
    scheduler.connector.runtime.drain()


def assert_tiers_agree(llm) -> None:
    """The worker holds a host copy of every key the index has in host memory, and
    nothing else but what the next step's operations drop or spill."""
    runtime = scheduler_of(llm).connector.runtime
    worker = worker_of(llm).store
    runtime.drain()
    indexed = {item.key for item in runtime.tiers.host}
    leaving = {key for op, key, _ in runtime._ops if op in ("drop", "spill")}
    assert indexed <= worker.host_keys()
    assert worker.host_keys() - indexed <= leaving


@pytest.fixture(scope="module")
def reference():
    """Cold greedy tokens without the connector (device cache reset before each prompt)."""
    out = {}
    with engine(MODEL, **ENGINE) as llm:
        for name, prompt in PROMPTS.items():
            llm.reset_prefix_cache()
            out[name] = list(_run(llm, prompt).outputs[0].token_ids)
        llm.reset_prefix_cache()
        turn1 = list(_run(llm, TURN1, TURN1_OUT).outputs[0].token_ids)
        out["turn2_prompt"] = TURN1 + turn1 + TURN2_NEW
        llm.reset_prefix_cache()
        out["turn2"] = list(_run(llm, out["turn2_prompt"]).outputs[0].token_ids)
    del llm
    return out


@pytest.fixture(scope="module")
def histate(reference, tmp_path_factory):
    directory = tmp_path_factory.mktemp("histate")
    with engine(MODEL, **histate_kwargs(directory=str(directory), host_bytes=256 << 20)) as llm:
        conn = scheduler_of(llm).connector
        # every expectation below counts in BLOCK-token blocks
        assert conn.block_size == BLOCK
        yield llm, conn
        conn.shutdown()  # persist now, not in an exit-time finalizer
    del llm


def _hit_tokens(conn) -> float:
    return conn.counters.value("hit_tokens")


def _restore(llm, conn, prompt, warm: bool = True):
    """Run ``prompt`` (to fill the tiers), reset vLLM's device cache, run it again."""
    if warm:
        _run(llm, prompt)
    conn.runtime.drain()
    llm.reset_prefix_cache()
    before = _hit_tokens(conn)
    out = _run(llm, prompt)
    return list(out.outputs[0].token_ids), _hit_tokens(conn) - before


@pytest.mark.parametrize("name", ["boundary", "boundary_minus_1", "boundary_plus_1", "multi_chunk"])
def test_restored_prefix_decodes_the_cold_tokens(histate, reference, name):
    llm, conn = histate
    prompt = PROMPTS[name]
    tokens, hit = _restore(llm, conn, prompt)
    assert tokens == reference[name]
    # the deepest boundary before the last prompt token, served by HiState
    assert hit == (len(prompt) - 1) // BLOCK * BLOCK
    assert conn.counters.value("snapshots_loaded_host") > 0


def test_a_shared_prefix_with_another_suffix_is_restored(histate, reference):
    llm, conn = histate
    _run(llm, PROMPTS["shared_a"])
    tokens, hit = _restore(llm, conn, PROMPTS["shared_b"], warm=False)
    assert tokens == reference["shared_b"]
    assert hit == 2 * BLOCK


def test_prefix_evicted_from_the_device_by_other_traffic(histate, reference):
    llm, conn = histate
    assert list(_run(llm, PROMPTS["evicted"]).outputs[0].token_ids) == reference["evicted"]
    for filler in FILLERS:
        _run(llm, filler, 2)
    conn.runtime.drain()
    before = _hit_tokens(conn)
    out = _run(llm, PROMPTS["evicted"])
    assert list(out.outputs[0].token_ids) == reference["evicted"]
    # vLLM's own cache lost the prefix; HiState served both blocks
    assert _hit_tokens(conn) - before == 2 * BLOCK


def test_held_snapshot_leaves_the_device_and_is_served_by_histate(histate, reference):
    """release_device_snapshots (the default): device blocks stay for KV, the state comes back."""
    llm, conn = histate
    assert conn.config.release_device_snapshots
    scheduler = scheduler_of(llm)
    pool = scheduler.kv_cache_manager.block_pool
    eng = llm.llm_engine
    released = conn.counters.value("device_snapshots_released")
    eng.add_request("rel", {"prompt_token_ids": PROMPTS["released"]}, _params())
    hashes, outputs = [], []
    while eng.has_unfinished_requests():
        (request,) = [r for r in scheduler.requests.values() if r.request_id.startswith("rel")]
        hashes = list(request.block_hashes)
        outputs.extend(o for o in eng.step() if o.finished)
        conn.runtime.drain()  # stores land before the next step frees blocks: deterministic
    assert list(outputs[0].outputs[0].token_ids) == reference["released"]
    assert conn.counters.value("device_snapshots_released") > released
    # the state at the prompt's last boundary (768 tokens) is held by a tier, and its
    # freed device block lost its cache entry; the KV blocks stay cached on the device
    boundary = hashes[1]  # block 1 ends at 768 tokens
    assert conn.runtime.has(snap_key(bytes(boundary).hex()))
    assert pool.get_cached_block(boundary, [conn.mamba_group]) is None
    assert all(pool.get_cached_block(h, [conn.attn_group]) for h in hashes[:2])
    before = _hit_tokens(conn)
    again = _run(llm, PROMPTS["released"])
    assert list(again.outputs[0].token_ids) == reference["released"]
    assert _hit_tokens(conn) - before == 2 * BLOCK  # vLLM had no state: HiState served it
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1


def test_second_turn_hits_a_state_stored_while_decoding(histate, reference):
    llm, conn = histate
    turn1 = list(_run(llm, TURN1, TURN1_OUT).outputs[0].token_ids)
    assert TURN1 + turn1 + TURN2_NEW == reference["turn2_prompt"]
    tokens, hit = _restore(llm, conn, reference["turn2_prompt"], warm=False)
    assert tokens == reference["turn2"]
    # 780 tokens were known after turn 1: the state at 768 was taken while decoding
    assert hit == 2 * BLOCK


def test_aborts_leave_nothing_pinned_pending_or_leaked(histate):
    llm, conn = histate
    scheduler = scheduler_of(llm)
    eng = llm.llm_engine
    # some hit HiState (the multi-chunk prefix is stored), some are aborted mid-prefill
    for i in range(4):
        prompt = PROMPTS["multi_chunk"][:1100] if i % 2 else _tokens(200 + i, 1100)
        eng.add_request(f"ab{i}", {"prompt_token_ids": prompt}, _params(20))
    for _ in range(3):
        eng.step()
    eng.abort_request(["ab0", "ab3"])
    while eng.has_unfinished_requests():
        eng.step()
    settle(llm)
    assert conn.idle_state() == IDLE
    conn.runtime.check_idle()
    assert_tiers_agree(llm)
    pool = scheduler.kv_cache_manager.block_pool
    # every block is back in the free queue (block 0 is the null block)
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
