"""ACCT's worker-side import plan on a tiny random Llama (no vLLM, CPU)."""

from __future__ import annotations

import math

import torch

from vllm_ext.acct.converter import Converters
from vllm_ext.acct.importer import CheckSettings, ImportJob, ImportStep, slot_mapping
from vllm_ext.acct.llama import LlamaShape, TorchLlama
from vllm_ext.acct.pipeline import AcctPipeline, own_prefill

BLOCK = 4
SHAPE = LlamaShape(32, 3, 2, 1, 16, 64, 97, 1e4, 1e-5, True)


def _model() -> TorchLlama:
    torch.manual_seed(0)
    model = TorchLlama(SHAPE).eval().requires_grad_(False)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return model


def _job(req: str, n: int, start: int, blocks: tuple[int, ...], seed: int) -> ImportJob:
    ids = torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    return ImportJob(req, tuple(ids), blocks, start)


class PagedCache:
    """A plain [slots, kv_heads, head_dim] store standing in for the backend's op."""

    def __init__(self, slots: int):
        self.k = torch.zeros(SHAPE.num_layers, slots, SHAPE.num_kv_heads, SHAPE.head_dim)
        self.v = torch.zeros_like(self.k)
        self.calls: list[int] = []

    def write(self, layer, key, value, slots):
        self.calls.append(layer)
        self.k[layer, slots] = key
        self.v[layer, slots] = value


def test_slot_mapping_follows_the_block_table():
    job = ImportJob("r", tuple(range(12)), (7, 3, 9), start=4)
    slots = slot_mapping(job, BLOCK, torch.device("cpu"))
    assert slots.tolist() == [12, 13, 14, 15, 36, 37, 38, 39]
    assert job.written_blocks(BLOCK) == [3, 9] and job.tokens == 8


def test_identity_import_writes_the_own_kv_at_its_slots_layer_by_layer():
    model = _model()
    jobs = [_job("a", 12, 4, (5, 1, 2), 1), _job("b", 8, 0, (3, 4), 2)]
    cache = PagedCache(6 * BLOCK)
    step = ImportStep(AcctPipeline(model, None), jobs, BLOCK, cache.write, torch.float32, None)
    step.run()
    step.wait(0)  # CPU: nothing to wait for
    result = step.finish()
    assert cache.calls == [0, 0, 1, 1, 2, 2]  # layer-major: layer j is complete before j + 1
    assert [j.req_id for j in result.imported] == ["a", "b"] and not result.errors
    for job in jobs:
        own = own_prefill(model, torch.tensor(job.token_ids))
        slots = slot_mapping(job, BLOCK, torch.device("cpu"))
        for layer, (k, v) in enumerate(own):
            assert torch.equal(cache.k[layer, slots], k[:, job.start :].transpose(0, 1))
            assert torch.equal(cache.v[layer, slots], v[:, job.start :].transpose(0, 1))
    # block 5 is "a"'s own cache hit (before its start), block 0 nobody's: not written
    assert torch.count_nonzero(cache.k[:, 20:24]) == torch.count_nonzero(cache.k[:, 0:4]) == 0


def test_errors_and_failed_checks_are_reported_not_raised():
    model = _model()
    converters = Converters(SHAPE, 1)
    for linear in converters.proj:
        torch.nn.init.normal_(linear.weight, std=5.0)
    pipeline = AcctPipeline(model, converters.requires_grad_(False), 2)
    good, bad = _job("good", 16, 0, (1, 2, 3, 4), 3), ImportJob("bad", (1, 2, 500, 3), (5,), 0)
    cache = PagedCache(6 * BLOCK)
    strict = CheckSettings(tokens=8, max_gap=-math.inf)  # nothing passes: exercises the path
    step = ImportStep(pipeline, [good, bad], BLOCK, cache.write, torch.float32, strict)
    step.run()
    result = step.finish()
    assert [j.req_id for j in result.errors] == ["bad"]  # token id out of the vocabulary
    assert [j.req_id for j in result.gate_failed] == ["good"] and not result.imported
    verdict = step.verdicts["good"]
    assert math.isfinite(verdict.nll_import) and math.isfinite(verdict.nll_local)
    lenient = ImportStep(pipeline, [good], BLOCK, cache.write, torch.float32,
                         CheckSettings(tokens=8, max_gap=math.inf))  # fmt: skip
    lenient.run()
    assert [j.req_id for j in lenient.finish().imported] == ["good"]
    assert lenient.finish().seconds >= 0
