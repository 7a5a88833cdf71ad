"""LEAP's probe on vLLM 0.34's Model Runner V2: each request's vector from the rows 0.34 names.

Random requests (seeded) run through 0.34's ``Scheduler`` with a small token
budget (chunked prefill), shared prompt prefixes under prefix caching (hits)
and few KV blocks (preemption). Each step builds 0.34's MRV2 ``InputBatch``
(:mod:`leap_mrv2_step`: its own row order, ``query_start_loc`` and padding),
runs a toy decoder on the batch's token ids and positions, and lets 0.34's
``ActiveKVConnector`` call LEAP's worker connector (``start_load_kv`` with the
kwargs 0.34 builds, then ``build_connector_worker_meta``). The probe is put
in place by LEAP's loader (``install_probe``, no V1 runner). Each vector LEAP
delivers must equal the toy decoder's state for that request's last prompt
token computed alone (``last`` pooling), or the mean of its states over the
prompt tokens computed since the request was last scheduled as new (``mean``:
a prefix hit or a preemption moves that start), and every request must get one. The toy layers treat
rows independently, so a wrong row gives a wrong vector.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from leap_mrv2_step import Mrv2Rows, active_kv_connector
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.outputs import ModelRunnerOutput

from vllm_ext.leap import loader
from vllm_ext.leap.batch_layout import V2StepLayout
from vllm_ext.leap.connector import LeapConnector, LeapMetadata

BLOCK = 16


class ToyLayer(torch.nn.Module):
    """A decoder layer's ``(hidden, residual)`` contract, each row on its own."""

    def __init__(self, k: int):
        super().__init__()
        self.k = k

    def forward(self, hidden, residual):
        residual = hidden if residual is None else hidden + residual
        return torch.tanh(residual * (self.k + 1) + self.k), residual


class ToyDecoder(torch.nn.Module):
    def __init__(self, hidden: int, num_layers: int, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.token_w = torch.nn.Parameter(torch.randn(hidden, generator=g) / 50)
        self.pos_w = torch.nn.Parameter(torch.randn(hidden, generator=g) / 50)
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList(ToyLayer(k) for k in range(num_layers))

    def forward(self, input_ids, positions):
        rows = input_ids[:, None].float() * self.token_w + positions[:, None].float() * self.pos_w
        hidden, residual = torch.sin(rows), None
        for layer in self.model.layers:
            hidden, residual = layer(hidden, residual)
        return hidden + residual

    def state_after(self, layer: int, token: int, position: int) -> np.ndarray:
        """Layer ``layer``'s residual stream for one token alone (the direct computation)."""
        rows = token * self.token_w + position * self.pos_w
        hidden, residual = torch.sin(rows)[None], None
        for k in range(layer + 1):
            hidden, residual = self.model.layers[k](hidden, residual)
        return (hidden + residual)[0].detach().numpy()


def _requests(rng, count: int):
    """Prompts over two shared prefixes (prefix hits) with random tails and lengths."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    prefixes = [rng.integers(1, 999, size=int(rng.integers(1, 4)) * BLOCK).tolist() for _ in "ab"]
    requests = []
    for i in range(count):
        shared = prefixes[int(rng.integers(0, 2))] if rng.random() < 0.6 else []
        tail = rng.integers(1, 999, size=int(rng.integers(1, 70))).tolist()
        params = SamplingParams(max_tokens=int(rng.integers(1, 30)), ignore_eos=True)
        params.update_from_generation_config({}, None)
        requests.append(
            Request(
                request_id=f"r{i}",
                prompt_token_ids=shared + tail,
                sampling_params=params,
                pooling_params=None,
                block_hasher=get_request_block_hasher(BLOCK, sha256),
            )
        )
    return requests


def _engine(rng, seed: int, monkeypatch, pooling: str = "last"):
    from tests.v1.core.utils import create_scheduler

    budget = int(rng.choice([32, 48, 64]))
    scheduler = create_scheduler(
        max_num_seqs=int(rng.integers(3, 7)),
        max_num_batched_tokens=budget,
        enable_prefix_caching=True,
        num_blocks=int(rng.integers(11, 15)),
        block_size=BLOCK,
        max_model_len=512,
    )
    vllm_config = scheduler.vllm_config
    layers = int(rng.integers(2, 5))
    layer = int(rng.integers(0, layers))
    same_step = {"probe_delivery": "same_step"}
    vllm_config.additional_config["leap"] = {
        "layer": layer,
        "pooling": pooling,
        "experimental": same_step,
    }
    model = ToyDecoder(vllm_config.model_config.get_hidden_size(), layers, seed)
    probe, steps = loader.install_probe(model, vllm_config, vllm_config.model_config)
    assert isinstance(steps, V2StepLayout)  # no V1 runner: the kwargs carry the rows
    monkeypatch.setattr(loader, "PROBE", probe)
    monkeypatch.setattr(loader, "V2_STEPS", steps)
    # the worker's config names the connector (the scheduler here runs without one)
    vllm_config.kv_transfer_config = KVTransferConfig(
        kv_connector="LeapConnector", kv_role="kv_both"
    )
    worker = LeapConnector(vllm_config, KVConnectorRole.WORKER, None)
    rows = Mrv2Rows(vllm_config, 16, budget, monkeypatch)
    return scheduler, model, layer, rows, active_kv_connector(vllm_config, worker)


def _run(seed: int, monkeypatch, pooling: str):
    """Step the engine to the end; returns (what happened, delivered and expected vectors)."""
    rng = np.random.default_rng(seed)
    scheduler, model, layer, rows, active = _engine(rng, seed, monkeypatch, pooling)
    requests = _requests(rng, int(rng.integers(8, 14)))
    prompts = {r.request_id: r.prompt_token_ids for r in requests}
    arrivals = sorted(int(t) for t in rng.integers(0, 20, size=len(requests)))
    admitted_at: dict[str, int] = {}  # tokens cached when last scheduled as new

    def expected(req_id: str) -> np.ndarray:
        prompt = prompts[req_id]
        # last: the last prompt token; mean: the prompt tokens this admission computed
        first = len(prompt) - 1 if pooling == "last" else admitted_at[req_id]
        states = [model.state_after(layer, prompt[p], p) for p in range(first, len(prompt))]
        return np.mean(states, axis=0)

    seen = {"preempted": 0, "prefix_hits": 0, "chunks": 0, "padded": 0, "reordered": 0}
    delivered: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
    for step in range(600):
        for request, at in zip(requests, arrivals, strict=True):
            if at == step:
                scheduler.add_request(request)
        if step > max(arrivals) and not scheduler.requests:
            break
        out = scheduler.schedule()
        out.kv_connector_metadata = LeapMetadata(frozenset(out.finished_req_ids))
        seen["preempted"] += len(out.preempted_req_ids or ())
        seen["prefix_hits"] += sum(n.num_computed_tokens > 0 for n in out.scheduled_new_reqs)
        admitted_at.update((n.req_id, n.num_computed_tokens) for n in out.scheduled_new_reqs)
        rows.update(out)
        if out.total_num_scheduled_tokens == 0:
            active.no_forward(out)
            continue
        padded = min(rows.max_tokens, out.total_num_scheduled_tokens + int(rng.integers(0, 9)))
        batch = rows.input_batch(out, padded)
        assert batch.num_tokens_after_padding == padded
        seen["padded"] += padded > batch.num_tokens
        # MRV2 sorts rows (decodes first, then by length), not in the scheduler's order
        seen["reordered"] += list(batch.req_ids) != list(out.num_scheduled_tokens)
        seen["chunks"] += sum(
            scheduler.requests[r].num_computed_tokens < scheduler.requests[r].num_prompt_tokens
            for r in batch.req_ids
        )
        with torch.inference_mode():  # as MRV2's execute_model and sample_tokens
            active.pre_forward(out, batch)
            model(batch.input_ids, batch.positions)
            active.finish_forward()
            meta = active.post_forward(out.finished_req_ids).kv_connector_worker_meta
        for req_id, vector in (meta.vectors if meta is not None else {}).items():
            delivered.setdefault(req_id, []).append((vector, expected(req_id)))
        sampled = []
        for req_id in batch.req_ids:
            request = scheduler.requests[req_id]
            done = request.num_computed_tokens >= request.num_tokens
            sampled.append([int(rng.integers(1, 999))] if done else [])
            if done:
                rows.append_output(req_id, sampled[-1][0])
        scheduler.update_from_output(
            out, ModelRunnerOutput(req_ids=list(batch.req_ids), sampled_token_ids=sampled)
        )
    assert not scheduler.requests, "the requests did not finish"
    return seen, delivered, set(prompts)


# seeds 0 and 1 keep MRV2's row order equal to the scheduler's throughout: left out
@pytest.mark.parametrize("seed", range(2, 12))
def test_each_vector_is_its_requests_prompt_state(seed, monkeypatch):
    pooling = "mean" if seed % 2 else "last"
    seen, delivered, req_ids = _run(seed, monkeypatch, pooling)
    assert set(delivered) == req_ids  # every request got its vector
    for req_id, pairs in delivered.items():
        # a preempted request recomputes its prompt: its vector is sent again
        for vector, expected in pairs:
            np.testing.assert_allclose(vector, expected, rtol=1e-5, atol=1e-6, err_msg=req_id)
    # each run chunked, hit the prefix cache, preempted, padded and reordered rows
    assert all(seen.values()), seen
