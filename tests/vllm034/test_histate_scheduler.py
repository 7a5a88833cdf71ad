"""HiStateConnector's scheduler half inside vLLM 0.34's Scheduler and hybrid KVCacheManager.

The Scheduler is 0.34's, built from the tiny Qwen3-Next hybrid's engine config
(``Qwen/Qwen3-Next-80B-A3B-Instruct`` resolves to it offline) with HiState as
its KV connector and a hybrid KV-cache config (one attention group, one
align-mode Mamba group, as 0.34 lays the model out), as vLLM's
``tests/v1/core/utils.py::create_scheduler`` builds one. HiState's worker half
runs in the test on small CPU pages; each step's ``ModelRunnerOutput`` is
fabricated as vLLM's own scheduler tests do, carrying what the worker half
reports. A request stores its blocks and boundary states; after vLLM's prefix
cache is reset the same prompt hits HiState's host tier, loads, and nothing
stays pinned or planned once every request is gone (as on 0.32).
"""

from __future__ import annotations

import pytest
import torch
from vllm.engine.arg_utils import EngineArgs
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from vllm_ext.common import compat
from vllm_ext.histate.connector import HiStateConnector

MODEL = "Qwen/Qwen3-Next-80B-A3B-Instruct"
NUM_BLOCKS = 48
ATTN = ["model.layers.1.self_attn.attn", "model.layers.3.self_attn.attn"]
GDN = ["model.layers.0.linear_attn", "model.layers.2.linear_attn"]
EOS = 0


@pytest.fixture
def histate_seams(monkeypatch):
    """compat's ``CachePolicy.touch`` entry (benchmarks/histate/sim.py's, gone in 0.34)
    disables all of HiState on 0.34: left out here, reported for the compat table."""
    seams = tuple(s for s in compat.SEAMS if s.qualname != "CachePolicy.touch")
    monkeypatch.setattr(compat, "SEAMS", seams)
    compat.require.cache_clear()
    assert compat.require("histate"), compat.problems("histate")
    yield
    compat.require.cache_clear()


def _scheduler() -> Scheduler:
    args = EngineArgs(
        model=MODEL, enable_prefix_caching=True, mamba_ssm_cache_dtype="bfloat16",
        max_num_batched_tokens=512, max_model_len=2048, dtype="bfloat16",
        kv_transfer_config={
            "kv_connector": "HiStateConnector",
            "kv_connector_module_path": "vllm_ext.histate.connector",
            "kv_role": "kv_both",
        },
        additional_config={"histate": {"ssd_bytes": 0}},  # host tier only: no files
    )  # fmt: skip
    vllm_config = args.create_engine_config()
    cache = vllm_config.cache_config
    assert cache.mamba_cache_mode == "align" and cache.mamba_block_size == cache.block_size
    block = cache.block_size
    kv_cache_config = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(ATTN, FullAttentionSpec(
                block_size=block, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)),
            KVCacheGroupSpec(GDN, MambaSpec(
                block_size=block, shapes=((3, 768), (4, 128, 128)),
                dtypes=(torch.bfloat16, torch.bfloat16), mamba_cache_mode="align",
            )),  # fmt: skip
        ],
    )
    cache.num_gpu_blocks = NUM_BLOCKS
    scheduler = Scheduler(
        vllm_config=vllm_config, kv_cache_config=kv_cache_config, block_size=block,
        log_stats=True, structured_output_manager=StructuredOutputManager(vllm_config),
    )  # fmt: skip
    assert isinstance(scheduler.connector, HiStateConnector)
    scheduler.worker = HiStateConnector(vllm_config, _worker_role(), kv_cache_config)
    scheduler.worker.register_kv_caches(_pages(vllm_config, kv_cache_config))
    return scheduler


def _worker_role():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    return KVConnectorRole.WORKER


def _pages(vllm_config, kv_cache_config) -> dict:
    """Small CPU pages per layer (block first), distinct per block so copies are checkable."""
    gen = torch.Generator().manual_seed(0)
    caches = {}
    for name in ATTN:
        caches[name] = torch.randn((NUM_BLOCKS, 2, 4, 2, 8), generator=gen).to(torch.bfloat16)
    for name in GDN:
        caches[name] = [
            torch.randint(-128, 128, (NUM_BLOCKS, n), generator=gen, dtype=torch.int8)
            for n in (16, 32)
        ]
    return caches


def _request(req_id: str, prompt: list[int], block: int, max_tokens: int = 2) -> Request:
    init_none_hash(sha256)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=False)
    params.update_from_generation_config({}, EOS)
    return Request(
        request_id=req_id, prompt_token_ids=prompt, sampling_params=params,
        pooling_params=None, block_hasher=get_request_block_hasher(block, sha256),
    )  # fmt: skip


def _step(scheduler: Scheduler, token: int = 7):
    """One engine step: schedule, run HiState's worker half, report back."""
    out = scheduler.schedule()
    worker = scheduler.worker
    worker.bind_connector_metadata(out.kv_connector_metadata)
    worker.start_load_kv(None)
    worker.wait_for_save()
    finished_sending, _ = worker.get_finished(out.finished_req_ids)
    meta = worker.build_connector_worker_meta()
    worker.clear_connector_metadata()
    req_ids = list(out.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        req = scheduler.requests[req_id]
        done = req.num_computed_tokens + out.num_scheduled_tokens[req_id] >= req.num_tokens
        sampled.append([token] if done else [])
    runner = ModelRunnerOutput(
        req_ids=req_ids, sampled_token_ids=sampled,
        kv_connector_output=KVConnectorOutput(
            finished_sending=finished_sending, kv_connector_worker_meta=meta
        ),
    )  # fmt: skip
    scheduler.update_from_output(out, runner)
    return out


def _run(scheduler: Scheduler, request: Request, max_steps: int = 20) -> list:
    scheduler.add_request(request)
    outs = []
    while scheduler.has_requests() and len(outs) < max_steps:
        outs.append(_step(scheduler))
    assert not scheduler.has_requests(), "request did not finish"
    return outs


def _counter(scheduler: Scheduler, name: str) -> int:
    return scheduler.connector.counters.value(name) + scheduler.worker.counters.value(name)


def test_a_prompt_stored_by_one_request_hits_after_vllms_cache_is_reset(histate_seams):
    scheduler = _scheduler()
    block = scheduler.block_size
    prompt = [100 + (i * 37) % 20000 for i in range(3 * block + 5)]
    first = _run(scheduler, _request("a", prompt, block))
    connector = scheduler.connector
    # prefill up to the last full block (a boundary state is taken there), then the rest
    assert first[0].num_scheduled_tokens == {"a": 3 * block}
    stores = [store for out in first for store in out.kv_connector_metadata.stores]
    kinds = sorted(key.split(":")[0] for key, _, _ in stores)
    # the three full attention blocks and the recurrent state at their end
    assert kinds == ["kv", "kv", "kv", "snap"]
    # and, once it finished, its tail: the partial block and the state at its exact end
    assert _counter(scheduler, "kv_blocks_stored") == 3 + 1
    assert _counter(scheduler, "snapshots_stored") == 1 + 1
    assert not any(out.kv_connector_metadata.loads for out in first)
    assert connector.idle_state() == dict.fromkeys(connector.idle_state(), 0)

    # vLLM forgets its device prefix cache; HiState's host tier still has the prefix
    assert scheduler.reset_prefix_cache()
    second = _run(scheduler, _request("b", prompt, block))
    (load,) = [job for out in second for job in out.kv_connector_metadata.loads]
    assert [key for _, key in load.kv] == [key for key, _, _ in stores if key.startswith("kv:")]
    assert load.snapshot_key == next(key for key, _, _ in stores if key.startswith("snap:"))
    # the three blocks were loaded, not recomputed: only the 5-token tail is
    assert second[0].num_scheduled_tokens == {"b": 5}
    assert _counter(scheduler, "hit_tokens") == 3 * block
    assert _counter(scheduler, "kv_blocks_loaded") == 3
    assert _counter(scheduler, "snapshots_loaded_host") == 1
    # the gauges and the histogram users graph: what the host tier holds, one restore
    counters = connector.counters
    assert counters.gauge("tier_used_bytes", "host") > 0
    assert counters.gauge("tier_capacity_bytes", "host") == connector.config.host_bytes
    assert counters.gauge("tier_capacity_bytes", "ssd") == 0  # ssd_bytes 0: no SSD tier
    assert counters.observed("restore_seconds") == 1
    # nothing leaks: no pinned plan or per-request state, every device block free again
    assert connector.idle_state() == dict.fromkeys(connector.idle_state(), 0)
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == NUM_BLOCKS - 1


def test_a_requests_exact_end_is_kept_and_the_next_turn_hits_it(histate_seams):
    """A tail: the state after the last computed token (not block aligned) and the KV of
    the partial block, copied while 0.34 holds the finished request's blocks."""
    scheduler = _scheduler()
    block = scheduler.block_size
    prompt = [100 + (i * 53) % 20000 for i in range(2 * block + 10)]
    first = _run(scheduler, _request("a", prompt, block, max_tokens=4))
    finals = [store for out in first for store in out.kv_connector_metadata.final_stores]
    # the partial KV block and the state, copied after vLLM called request_finished
    assert sorted(key.split(":")[0] for key, _, _ in finals) == ["kv", "snap"]
    assert [r for out in first for r in out.kv_connector_metadata.releases] == ["a"]
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == NUM_BLOCKS - 1
    # the next turn: the first turn's tokens (all but the last output) plus a new message
    end = 2 * block + 10 + 3
    turn2 = prompt + [7, 7, 7, 7] + [200 + i for i in range(30)]
    assert scheduler.reset_prefix_cache()
    second = _run(scheduler, _request("b", turn2, block))
    (load,) = [job for out in second for job in out.kv_connector_metadata.loads]
    assert load.kv[-1][1] == next(key for key, _, _ in finals if key.startswith("kv:"))
    assert load.snapshot_key == next(key for key, _, _ in finals if key.startswith("snap:"))
    assert second[0].num_scheduled_tokens == {"b": len(turn2) - end}
    assert _counter(scheduler, "hit_tokens") == end
    connector = scheduler.connector
    assert connector.idle_state() == dict.fromkeys(connector.idle_state(), 0)
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == NUM_BLOCKS - 1
