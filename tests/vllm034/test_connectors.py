"""ACCT's and ARK's KV connectors (and LEAP's, built only) on vLLM 0.34's own code.

Built by 0.34's ``KVConnectorFactory`` from ``KVTransferConfig``s with
``kv_connector_module_path``; the scheduler halves go through requests' lives
on 0.34's ``Scheduler`` with fabricated ``ModelRunnerOutput``s (as vLLM's
``tests/v1/kv_connector/unit`` do), each ending with vLLM's own leak check; the
worker halves run on CPU, created the way 0.34 creates them after warm-up
(committed block count, padded layer regions, 0.34's own KV views). 0.34's new
connector API: ``kv_cache_access()`` as the config and MultiConnector read it,
``requires_kv_delivery`` and ``may_load_async`` as the scheduler reads them.
"""

from __future__ import annotations

import time

import pytest

# vLLM's own test helpers: 0.34's sdist puts them on the path (make test-034); under the
# installed 0.32 the tier is skipped, and this keeps its collection from failing first
pytest.importorskip("tests.v1.kv_connector.unit.utils")

import torch
from connectors034 import (
    ARK_NIXL,
    BLOCK,
    LEAP,
    acct_config,
    ark_config,
    finished_outputs,
    layer_names,
    leap_config,
    scheduler_for,
    step,
    worker_after_warm_up,
)
from tests.v1.kv_connector.unit.utils import (
    assert_scheduler_empty,
    create_model_runner_output,
    create_request,
)
from vllm.config import KVTransferConfig
from vllm.config.kv_transfer import KVCacheAccess
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.forward_context import get_forward_context, set_forward_context
from vllm.v1.request import RequestStatus
from vllm.v1.worker.extensible_kv_cache import registers_kv_cache_memory

from vllm_ext.acct.connector import AcctConnector, AcctMetadata
from vllm_ext.acct.importer import ImportJob
from vllm_ext.ark.connector import ArkConnector, ArkMetadata, LoadJob, SendJob
from vllm_ext.leap.connector import LeapConnector
from vllm_ext.serving import free_port

CONFIGS = {
    "acct": (acct_config, AcctConnector),
    "ark-prefill": (lambda: ark_config("kv_producer"), ArkConnector),
    "ark-decode": (lambda: ark_config("kv_consumer"), ArkConnector),
    "leap": (leap_config, LeapConnector),
}


@pytest.fixture
def scheduler_of():
    """Build a 0.34 scheduler around a connector config; shut its connector down after."""
    built = []

    def build(config, num_blocks=200):
        scheduler = scheduler_for(config, num_blocks)
        built.append(scheduler)
        return scheduler

    yield build
    for scheduler in built:
        scheduler.connector.shutdown()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_factory_builds_each_connector_in_both_roles(name, scheduler_of):
    make_config, cls = CONFIGS[name]
    config = make_config()
    scheduler = scheduler_of(config)
    assert type(scheduler.connector) is cls
    worker = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER,
                                                 scheduler.kv_cache_config)  # fmt: skip
    assert type(worker) is cls and worker.role == KVConnectorRole.WORKER
    worker.shutdown()


def _child(connector: dict, role: str, **extra) -> dict:
    return {**connector, "kv_role": role, **extra}


@pytest.mark.parametrize(
    "transfer, access",
    [
        # ACCT writes through the attention backend's op; ARK copies with torch ops
        (dict(kv_connector="AcctConnector", kv_role="kv_both",
              kv_connector_module_path="vllm_ext.acct.connector"), KVCacheAccess.IN_PROCESS),
        (dict(kv_connector="ArkConnector", kv_role="kv_producer",
              kv_connector_module_path="vllm_ext.ark.connector"), KVCacheAccess.IN_PROCESS),
        # ARK on NIXL: UCX registers the device cache (and peers on a host import it) ...
        (dict(kv_role="kv_consumer", kv_buffer_device="cuda", **ARK_NIXL),
         KVCacheAccess.REGISTERS | KVCacheAccess.EXPORTS_FABRIC),
        # ... but only host staging buffers with a CPU KV buffer
        (dict(kv_role="kv_consumer", kv_buffer_device="cpu", **ARK_NIXL),
         KVCacheAccess.IN_PROCESS),
        # MultiConnector ORs its children
        (dict(kv_connector="MultiConnector", kv_role="kv_both", kv_connector_extra_config={
            "connectors": [_child(LEAP, "kv_both"),
                           _child(ARK_NIXL, "kv_consumer", kv_buffer_device="cuda")]}),
         KVCacheAccess.REGISTERS | KVCacheAccess.EXPORTS_FABRIC),
        (dict(kv_connector="MultiConnector", kv_role="kv_both", kv_connector_extra_config={
            "connectors": [_child(LEAP, "kv_both"),
                           _child({"kv_connector": "AcctConnector", "kv_connector_module_path":
                                   "vllm_ext.acct.connector"}, "kv_both")]}),
         KVCacheAccess.IN_PROCESS),
    ],
    ids=["acct", "ark-tcp", "ark-nixl", "ark-nixl-cpu-buffer", "multi-leap-ark-nixl",
         "multi-leap-acct"],
)  # fmt: skip
def test_kv_cache_access_as_0_34_reads_it(transfer, access):
    kv_transfer_config = KVTransferConfig(**transfer)
    assert kv_transfer_config.kv_cache_access() == access
    # what the worker asks before committing the extensible KV cache (one chunk per segment)
    config = leap_config()
    config.kv_transfer_config = kv_transfer_config
    assert registers_kv_cache_memory(config) == access.needs_single_chunk()


@pytest.mark.parametrize(
    "name, delivers, loads_async",
    [("acct", False, False), ("ark-prefill", True, False), ("ark-decode", False, True),
     ("leap", False, False)],
)  # fmt: skip
def test_delivery_and_async_load_flags_reach_the_scheduler(name, delivers, loads_async,
                                                           scheduler_of):  # fmt: skip
    config = CONFIGS[name][0]()
    config.scheduler_config.max_num_inflight_kv_loads = 2
    scheduler = scheduler_of(config)
    assert scheduler.requires_kv_delivery is delivers
    # a P/D decode request: only ARK's decode side loads it asynchronously, so only
    # there may it start loading while the running batch is full
    request = create_request(num_tokens=3 * BLOCK, do_remote_prefill=True, block_size=BLOCK)
    assert scheduler.connector.may_load_async(request) is loads_async
    scheduler.add_request(request)
    queue = scheduler.async_kv_waiting if loads_async else scheduler.waiting
    assert list(queue) == [request]


def test_acct_imports_a_prefix_through_a_requests_life(scheduler_of):
    scheduler = scheduler_of(acct_config())
    request = create_request(num_tokens=6 * BLOCK + 5, max_tokens=3, block_size=BLOCK)
    scheduler.add_request(request)
    out, _ = step(scheduler, [request])
    # the block-aligned prefix before the last prompt token is imported, synchronously:
    # 0.34's runner then calls start_load_kv before the forward
    assert out.has_sync_kv_loads
    assert out.num_scheduled_tokens[request.request_id] == 5
    (job,) = out.kv_connector_metadata.jobs
    blocks = scheduler.kv_cache_manager.get_block_ids(request.request_id)[0]
    assert job == ImportJob(request.request_id, tuple(request.prompt_token_ids[: 6 * BLOCK]),
                            tuple(blocks[:6]), 0)  # fmt: skip
    done = {}
    while not done:
        out, outputs = step(scheduler, [request])
        assert out.kv_connector_metadata.jobs == [] and not out.has_sync_kv_loads
        done = finished_outputs(outputs)
    assert request.num_output_tokens == 3
    step(scheduler, [])  # hands the finished request to the workers
    assert all(v == 0 for v in scheduler.connector.idle_state().values())
    assert_scheduler_empty(scheduler)


def test_acct_failed_import_is_recomputed_by_0_34(scheduler_of):
    scheduler = scheduler_of(acct_config())
    request = create_request(num_tokens=4 * BLOCK + 3, max_tokens=2, block_size=BLOCK)
    scheduler.add_request(request)
    out = scheduler.schedule()
    (job,) = out.kv_connector_metadata.jobs
    # the worker's online check rejected the import: it reports the blocks it wrote
    failed = create_model_runner_output([request], invalid_block_ids=set(job.block_ids))
    scheduler.update_from_output(out, failed)
    # vLLM recomputes the prefix itself (the whole prompt: every block failed);
    # ACCT does not offer it again
    assert request.num_computed_tokens == 0
    out, _ = step(scheduler, [request])
    assert out.kv_connector_metadata.jobs == [] and not out.has_sync_kv_loads
    assert out.num_scheduled_tokens[request.request_id] == 4 * BLOCK + 3
    while not request.is_finished():
        step(scheduler, [request])
    step(scheduler, [])
    assert all(v == 0 for v in scheduler.connector.idle_state().values())
    assert_scheduler_empty(scheduler)


def _remote_decode(request, transfer_id: str, data_port: int):
    request.kv_transfer_params.update(transfer_id=transfer_id, remote_host="127.0.0.1",
                                      remote_port=data_port)  # fmt: skip
    return request


def test_ark_prefill_sends_from_a_planned_port_through_a_requests_life(scheduler_of):
    config = ark_config("kv_producer", port_base=41000, port_count=4)
    scheduler = scheduler_of(config)
    request = create_request(num_tokens=2 * BLOCK + 5, do_remote_decode=True, block_size=BLOCK)
    _remote_decode(request, "t-1", 7999)
    scheduler.add_request(request)
    out, outputs = step(scheduler, [request])
    (send,) = out.kv_connector_metadata.sends
    blocks = scheduler.kv_cache_manager.get_block_ids(request.request_id)[0]
    assert send.block_ids == tuple(blocks[:3]) and send.dst == ("127.0.0.1", 7999)
    assert send.port in range(41000, 41004) and send.transfer_id == "t-1"
    # one token, then the blocks stay until the worker has sent them
    finished = finished_outputs(outputs)[request.request_id]
    assert finished.kv_transfer_params == {"transfer_id": "t-1", "ark_port": send.port}
    assert request.request_id in scheduler.requests
    out, _ = step(scheduler, [])
    assert request.request_id in out.finished_req_ids
    step(scheduler, [], finished_sending={request.request_id})
    assert_scheduler_empty(scheduler)


@pytest.mark.parametrize("lost", [False, True], ids=["arrives", "lost"])
def test_ark_decode_loads_asynchronously_through_a_requests_life(lost, scheduler_of):
    scheduler = scheduler_of(ark_config("kv_consumer"))
    request = create_request(num_tokens=3 * BLOCK + 2, do_remote_prefill=True, max_tokens=2,
                             block_size=BLOCK)  # fmt: skip
    request.kv_transfer_params["transfer_id"] = "t-2"
    scheduler.add_request(request)
    out, _ = step(scheduler, [request])
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS and not out.has_sync_kv_loads
    (load,) = out.kv_connector_metadata.loads
    blocks = scheduler.kv_cache_manager.get_block_ids(request.request_id)[0]
    assert load == LoadJob(request.request_id, "t-2", tuple(blocks[:4]), 0)
    # the worker reports the load done; a lost frame also reports its blocks as failed
    invalid = set(load.block_ids) if lost else None
    step(scheduler, [], finished_recving={request.request_id}, invalid_block_ids=invalid)
    out, _ = step(scheduler, [request])
    # vLLM computes the last prompt token over loaded KV, or the whole prompt (recompute)
    assert out.num_scheduled_tokens[request.request_id] == (3 * BLOCK + 2 if lost else 1)
    while not request.is_finished():
        step(scheduler, [request])
    step(scheduler, [])
    assert_scheduler_empty(scheduler)


@pytest.mark.parametrize("kernel_block_size", [None, BLOCK // 4], ids=["block", "kernel-split"])
def test_ark_workers_move_kv_on_loopback_when_created_after_warm_up(kernel_block_size):
    prefill, decode = ark_config("kv_producer"), ark_config("kv_consumer")
    # each side commits its own block count after warm-up, below the reserved capacity;
    # with kernel-split pages, block b is kernel blocks 4b..4b+3 of the view
    sender, src = worker_after_warm_up(prefill, 23, 40, kernel_block_size)
    receiver, dst = worker_after_warm_up(decode, 29, 40, kernel_block_size)
    ratio = BLOCK // (kernel_block_size or BLOCK)

    def rows(blocks):
        return [b * ratio + j for b in blocks for j in range(ratio)]

    try:
        torch.manual_seed(0)
        for tensor in src.values():
            tensor.copy_(torch.randn_like(tensor))
        data_port = decode.additional_config["ark"]["data_port"]
        sender.bind_connector_metadata(ArkMetadata(sends=[
            SendJob("r1", "t-1", (3, 7, 11), ("127.0.0.1", data_port), free_port())]))  # fmt: skip
        sender.start_load_kv(None)
        sender.wait_for_save()
        sender.clear_connector_metadata()
        # the copy is out: the blocks go back once vLLM has finished the request
        assert sender.get_finished(set()) == (None, None)
        assert sender.get_finished({"r1"}) == ({"r1"}, None)
        # a sleep between steps (0.34 calls these around it): ARK holds views only
        receiver.unregister_kv_caches()
        receiver.restore_kv_caches()
        receiver.bind_connector_metadata(ArkMetadata(loads=[LoadJob("r1", "t-1", (5, 2, 20), 0)]))
        receiver.start_load_kv(None)
        receiver.clear_connector_metadata()
        deadline = time.monotonic() + 20
        results = receiver.get_transfer_results(set())
        while not results.finished_recving and time.monotonic() < deadline:
            time.sleep(0.05)
            results = receiver.get_transfer_results(set())
        assert results.finished_recving == {"r1"}
        assert receiver.get_block_ids_with_load_errors() == set()
        for name, tensor in dst.items():
            assert tensor.shape[0] == 29 * ratio
            assert torch.equal(tensor[rows([5, 2, 20])], src[name][rows([3, 7, 11])]), name
            assert not tensor[rows([0, 1, 3, 4])].any(), name
    finally:
        sender.shutdown()
        receiver.shutdown()


class _RecordingAttentionImpl:
    """Stands in for the CPU attention backend's cache write, whose op (``vllm._C``) is
    not in 0.34's sdist here: records what ACCT hands to ``do_kv_cache_update``."""

    def __init__(self, writes: dict):
        self.writes = writes

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        self.writes[layer.layer_name] = (key.clone(), value.clone(), slot_mapping.clone(),
                                         kv_cache)  # fmt: skip


class _Layer(torch.nn.Module):
    def __init__(self, layer_name: str, impl):
        super().__init__()
        self.layer_name, self.impl = layer_name, impl


def _plain_kv(config, token_ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer ``(key, value)`` ``[tokens, kv_heads, head_dim]`` of a plain HF forward."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(config.model_config.model,
                                                 dtype=torch.float32)  # fmt: skip
    with torch.no_grad():
        cache = model(torch.tensor([token_ids]), use_cache=True).past_key_values
    return [(layer.keys[0].transpose(0, 1), layer.values[0].transpose(0, 1))
            for layer in cache.layers]  # fmt: skip


def test_acct_worker_writes_the_models_own_kv_when_created_after_warm_up():
    config = acct_config()
    worker, caches = worker_after_warm_up(config, num_blocks=12, capacity=40)
    writes: dict = {}
    impl = _RecordingAttentionImpl(writes)
    layers = config.compilation_config.static_forward_context
    for name in layer_names(config):
        layers[name] = _Layer(name, impl)
    token_ids = torch.randint(100, 40000, (6 * BLOCK,), generator=torch.Generator().manual_seed(3))
    token_ids = token_ids.tolist()
    block_ids = (4, 9, 1, 7, 11, 0)
    worker.bind_connector_metadata(AcctMetadata(jobs=[ImportJob("r1", tuple(token_ids),
                                                                block_ids, 0)]))  # fmt: skip
    # a step with a synchronous load: 0.34's runner calls start_load_kv before the forward,
    # outside any forward context, with Model Runner V2's batch keywords
    with set_forward_context(None, config):
        worker.start_load_kv(get_forward_context(), scheduler_output=None, request_ids=["r1"])
    for name in layer_names(config):
        worker.wait_for_layer_load(name)
    worker.clear_connector_metadata()
    assert worker.get_block_ids_with_load_errors() == set()
    assert worker.counters.value("imported_tokens") == 6 * BLOCK
    slots = torch.tensor([block_ids[t // BLOCK] * BLOCK + t % BLOCK for t in range(6 * BLOCK)])
    for name, (key, value) in zip(layer_names(config), _plain_kv(config, token_ids), strict=True):
        got_key, got_value, got_slots, kv_cache = writes[name]
        assert kv_cache is caches[name]  # the committed view registered for that layer
        assert torch.equal(got_slots, slots)
        torch.testing.assert_close(got_key, key, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got_value, value, rtol=1e-4, atol=1e-4)
