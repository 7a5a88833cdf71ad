"""LEAP's probe on Model Runner V2's batch, built on CPU with vLLM's own V2 structures.

V2 cannot run on this CPU build (it needs Triton), so the step is assembled from
vLLM's classes: a ``SchedulerOutput`` of new and running requests, V2's
``InputBatch`` with the rows in a shuffled order, and the ``start_load_kv``
kwargs V2's ``ActiveKVConnector._build_load_kwargs`` makes from them. The probe
must find each request's rows from those kwargs alone, and agree with the V1
path (the same batch read as a runner slice) and with a direct computation.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_ext.leap.batch_layout import V2StepLayout
from vllm_ext.leap.probe import ProbeError, ProbeState, RunnerSliceLayout

HIDDEN = 3
REFINE_EVERY = 4


def _random_step(rng):
    """Requests of a step: (req_id, prompt, computed before, scheduled, is new)."""
    reqs = []
    for i in range(int(rng.integers(1, 9))):
        prompt = int(rng.integers(1, 40))
        if rng.random() < 0.5:  # a prefill chunk, maybe past a cache hit
            computed = int(rng.integers(0, prompt))
            scheduled = int(rng.integers(1, prompt - computed + 1))
        else:  # decoding
            computed = prompt + int(rng.integers(0, 12))
            scheduled = 1
        new = computed < prompt and rng.random() < 0.6
        reqs.append((f"req-{i}", prompt, computed, scheduled, new))
    return reqs


def _scheduler_output(reqs):
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    out = SchedulerOutput.make_empty()
    cached = CachedRequestData.make_empty()
    for req_id, prompt, computed, scheduled, new in reqs:
        out.num_scheduled_tokens[req_id] = scheduled
        if new:
            out.scheduled_new_reqs.append(
                NewRequestData(req_id, list(range(prompt)), [], None, None, ([],), computed, None)
            )
        else:
            cached.req_ids.append(req_id)
            cached.num_computed_tokens.append(computed)
    out.scheduled_cached_reqs = cached
    out.total_num_scheduled_tokens = sum(out.num_scheduled_tokens.values())
    return out


def _v2_input_batch(order, reqs):
    """V2's InputBatch (vLLM 0.32 ``vllm.v1.worker.gpu.input_batch``) with rows in ``order``."""
    from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers

    rows = [reqs[i] for i in order]
    counts = np.array([r[3] for r in rows], dtype=np.int32)
    total = int(counts.sum())
    dummy = InputBatch.make_dummy(len(rows), total, InputBuffers(16, 512, torch.device("cpu")))
    starts = np.zeros(len(rows) + 1, dtype=np.int32)
    np.cumsum(counts, out=starts[1:])
    return dataclasses.replace(
        dummy,
        req_ids=[r[0] for r in rows],
        num_scheduled_tokens=counts,
        query_start_loc_np=starts,
        num_computed_tokens_np=np.array([r[2] for r in rows], dtype=np.int32),
    )


def _v2_kwargs(scheduler_output, input_batch):
    from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector

    return ActiveKVConnector._build_load_kwargs(scheduler_output, input_batch, None)


def _probe(rows: int, pooling: str = "last") -> ProbeState:
    probe = ProbeState(0, pooling, HIDDEN, 512, refine_every=REFINE_EVERY)
    probe.buffer = torch.arange(512 * HIDDEN, dtype=torch.float32).reshape(512, HIDDEN)
    probe.rows_written = rows
    return probe


def _expected(order, reqs, buffer):
    """Prompt-end rows and due decode rows, straight from the row definitions."""
    prompts, decodes, start = {}, {}, 0
    for i in order:
        req_id, prompt, computed, scheduled, _ = reqs[i]
        if computed < prompt <= computed + scheduled:
            prompts[req_id] = buffer[start + prompt - 1 - computed].tolist()
        generated = computed - prompt + 1
        if scheduled == 1 and generated > 0 and generated % REFINE_EVERY == 0:
            decodes[req_id] = (generated, buffer[start].tolist())
        start += scheduled
    return prompts, decodes


def _as_lists(out):
    prompts, decodes = out
    return (
        {k: v.tolist() for k, v in prompts.items()},
        {k: (g, v.tolist()) for k, (g, v) in decodes.items()},
    )


@pytest.mark.parametrize("seed", range(12))
def test_v2_kwargs_locate_every_requests_rows_as_v1_and_direct(seed):
    rng = np.random.default_rng(seed)
    reqs = _random_step(rng)
    order = rng.permutation(len(reqs)).tolist()  # V2's row order is not the dict order
    scheduler_output = _scheduler_output(reqs)
    batch = _v2_input_batch(order, reqs)
    kwargs = _v2_kwargs(scheduler_output, batch)
    assert kwargs["request_ids"] == batch.req_ids

    v2 = _probe(int(batch.query_start_loc_np[-1]))
    steps = V2StepLayout()
    v2.bind_layout(steps)
    # the running requests were scheduled as new in an earlier step
    earlier = [(r[0], r[1], 0, 1, True) for r in reqs if not r[4]]
    if earlier:
        steps.observe(_scheduler_output(earlier), [r[0] for r in earlier])
        steps.layout()
    steps.observe(kwargs["scheduler_output"], kwargs["request_ids"])
    got = _as_lists(v2.collect())

    v1 = _probe(int(batch.query_start_loc_np[-1]))
    v1.bind_layout(RunnerSliceLayout(_runner_slice(order, reqs, batch)))
    assert _as_lists(v1.collect()) == got
    assert got == _expected(order, reqs, v2.buffer)


def _runner_slice(order, reqs, batch):
    """The same batch as the V1 runner exposes it."""
    rows = [reqs[i] for i in order]
    input_batch = SimpleNamespace(
        num_reqs=len(rows),
        req_ids=batch.req_ids,
        num_computed_tokens_cpu=np.array([r[2] for r in rows]),
        num_prompt_tokens=np.array([r[1] for r in rows]),
    )
    return SimpleNamespace(
        input_batch=input_batch,
        query_start_loc=SimpleNamespace(cpu=torch.tensor(batch.query_start_loc_np)),
    )


def test_a_step_is_announced_once_and_prompts_are_kept_until_finished():
    reqs = [("a", 6, 0, 6, True), ("b", 4, 0, 2, True)]
    steps = V2StepLayout()
    steps.observe(_scheduler_output(reqs), ["b", "a"])
    first = steps.layout()
    assert first.req_ids == ["b", "a"] and first.starts.tolist() == [0, 2, 8]
    assert steps.layout() is None  # a no-forward step brings no layout
    # "b" continues as a running request: its prompt length is remembered
    steps.observe(_scheduler_output([("b", 4, 2, 2, False)]), ["b"])
    assert steps.layout().prompt.tolist() == [4]
    steps.forget(["b"])
    with pytest.raises(ProbeError, match="never scheduled as new"):
        steps.observe(_scheduler_output([("b", 4, 4, 1, False)]), ["b"])


def test_observe_type_checks_what_vllm_passed():
    with pytest.raises(ProbeError, match="SchedulerOutput"):
        V2StepLayout().observe({"num_scheduled_tokens": {}}, [])
    with pytest.raises(ProbeError, match="request id"):
        V2StepLayout().observe(_scheduler_output([("a", 2, 0, 2, True)]), [7])


def test_trimmed_drafts_leave_the_rows_after_the_verifying_requests_known():
    # adaptive verification: "v1" (decoding) and "v2" (its last prompt token, with
    # placeholder drafts) verify drafts and lead; the device ran 1 of their 6 draft rows
    reqs = [("v1", 5, 9, 4, False), ("v2", 10, 9, 4, False), ("p", 20, 0, 20, True)]
    out = _scheduler_output(reqs)
    out.scheduled_spec_decode_tokens = {"v1": [7, 7, 7], "v2": [7, 7, 7]}
    steps = V2StepLayout()
    steps.observe(_scheduler_output([(r[0], r[1], 0, 1, True) for r in reqs[:2]]), ["v1", "v2"])
    steps.layout()
    steps.observe(out, ["v1", "v2", "p"], num_tokens=23)
    layout = steps.layout()
    assert layout.known.tolist() == [False, False, True]
    assert layout.starts[2:].tolist() == [3, 23] and layout.written == 23
    probe = _probe(32)
    probe.bind_layout(SimpleNamespace(layout=lambda: layout, forget=lambda ids: None))
    # "p"'s last prompt token is row 3 + 19; "v2"'s prompt end is somewhere unknown: not read
    assert _as_lists(probe.collect()) == ({"p": probe.buffer[22].tolist()}, {})
    with pytest.raises(ProbeError, match="leading requests"):
        steps.observe(out, ["p", "v1", "v2"], num_tokens=23)
