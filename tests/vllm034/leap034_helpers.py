"""LEAP's scheduler built and stepped the way vLLM 0.34's own scheduler tests do.

``create_scheduler`` is vLLM's (``tests/v1/core/utils.py``) with our factory as
``scheduler_cls`` and LEAP's block in ``additional_config``; steps feed the
scheduler fabricated ``ModelRunnerOutput`` s (one token per request that is
past its prompt), as vLLM's tests do. :class:`RemotePrefillConnector` is a
KV-loading connector in the shape of P/D's (an asynchronous load for each
request flagged ``do_remote_prefill``), to compose with LEAP's through vLLM's
MultiConnector.
"""

from __future__ import annotations

import itertools
import time
import zlib
from pathlib import Path

import numpy as np
from vllm import SamplingParams
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

from vllm_ext.common import compat
from vllm_ext.common.config import config_block
from vllm_ext.leap.config import LeapConfig
from vllm_ext.leap.connector import LeapWorkerMetadata
from vllm_ext.leap.predictor import LinearLengthModel
from vllm_ext.leap.runtime import HINT_KEY
from vllm_ext.leap.scheduler import make_scheduler
from vllm_ext.leap.settings import SYSTEM

LEAP = {
    "kv_connector": "LeapConnector",
    "kv_connector_module_path": "vllm_ext.leap.connector",
    "kv_role": "kv_both",
}
REMOTE = {
    "kv_connector": "RemotePrefillConnector",
    "kv_connector_module_path": __name__,
    "kv_role": "kv_both",
}
BLOCK = 16
_ARRIVALS = itertools.count()


def register_leap_connector() -> None:
    """LeapConnector by name, as vllm_ext's plugin registers it (vLLM's tests pass names)."""
    compat.register_connector_once("LeapConnector", "vllm_ext.leap.connector", "LeapConnector")


def leap_factory(leap: dict | None = None, scheduler_cls=make_scheduler,
                 inflight_kv_loads: int | None = None):  # fmt: skip
    """A ``scheduler_cls`` for vLLM's ``create_scheduler``: puts LEAP's settings into
    the VllmConfig it is handed (where ``--additional-config`` puts them) and
    ``--max-num-inflight-kv-loads`` (vLLM's helper takes neither), then builds
    ``scheduler_cls`` (LEAP's factory; vLLM's plain Scheduler to watch a test fail)."""

    def build(*, vllm_config, **kwargs):
        vllm_config.additional_config = {SYSTEM: config_block(LeapConfig, leap or {})}
        vllm_config.scheduler_config.max_num_inflight_kv_loads = inflight_kv_loads
        return scheduler_cls(vllm_config=vllm_config, **kwargs)

    return build


def leap_scheduler(leap: dict | None = None, scheduler_cls=make_scheduler,
                   inflight_kv_loads: int | None = None, **kwargs):  # fmt: skip
    """vLLM's ``create_scheduler`` with LEAP's scheduler and connector."""
    from tests.v1.core.utils import create_scheduler

    register_leap_connector()
    kwargs.setdefault("block_size", BLOCK)
    kwargs.setdefault("use_kv_connector", "LeapConnector")
    return create_scheduler(
        scheduler_cls=leap_factory(leap, scheduler_cls, inflight_kv_loads), **kwargs
    )


def with_remote_prefill(monkeypatch) -> dict:
    """``create_scheduler`` kwargs for a MultiConnector of the remote-prefill loader and
    LEAP's connector (vLLM's helper builds a config from a connector name only)."""
    import tests.v1.core.utils as utils

    def transfer_config(**_):
        return KVTransferConfig(
            kv_connector="MultiConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"connectors": [REMOTE, LEAP]},
        )

    monkeypatch.setattr(utils, "KVTransferConfig", transfer_config)
    return {"use_kv_connector": "MultiConnector"}


def request(rid: str, prompt: list[int], max_tokens: int, hint: int | None = None,
            remote: bool = False) -> Request:  # fmt: skip
    """A request of ``max_tokens`` (EOS ignored), with LEAP's length hint; arrivals are
    distinct and in creation order (LEAP ages requests by their arrival time)."""
    params = SamplingParams(
        max_tokens=max_tokens,
        ignore_eos=True,
        extra_args={HINT_KEY: hint} if hint is not None else None,
    )
    params.update_from_generation_config({}, 50256)
    made = Request(
        request_id=rid,
        prompt_token_ids=prompt,
        sampling_params=params,
        pooling_params=None,
        arrival_time=time.time() + next(_ARRIVALS) * 1e-3,
        block_hasher=_block_hasher(),
    )
    if remote:
        made.kv_transfer_params = {"do_remote_prefill": True}
    return made


def _block_hasher():
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    init_none_hash(sha256)
    return get_request_block_hasher(BLOCK, sha256)


def write_weights(path: Path, dim: int, seed: int = 0) -> Path:
    """A LEAP weights file for ``dim``-wide probe vectors (a random ridge fit: informative)."""
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(64, dim))
    LinearLengthModel.fit_ridge(X, rng.integers(2, 200, size=64).astype(float)).save(path)
    return path


def probe_vector(request_id: str, dim: int) -> np.ndarray:
    """The probe vector a request's prefill 'reads' (fixed per request id)."""
    return np.random.default_rng(zlib.crc32(request_id.encode())).normal(size=dim).astype("f4")


class Stepper:
    """Runs a scheduler: schedule, then a fabricated output for what was scheduled.

    ``probe_dim``: also send LEAP's worker metadata, a probe vector
    (:func:`probe_vector`) for each request whose prompt ends in the step, as
    the worker's probe would.
    """

    def __init__(self, scheduler, probe_dim: int | None = None):
        self.scheduler = scheduler
        self.probe_dim = probe_dim
        self.started: list[str] = []  # request ids in the order they first ran
        self.loads: list[str] = []  # in the order their asynchronous KV load started
        self.finished: list[str] = []
        self.outputs: dict[str, list[int]] = {}
        self._load_started: dict[str, int] = {}  # request id -> step its load started

    def step(self, finished_recving: set[str] | None = None) -> None:
        scheduler = self.scheduler
        out = scheduler.schedule()
        for rid in out.num_scheduled_tokens:
            if rid not in self.started:
                self.started.append(rid)
        for rid, req in scheduler.requests.items():
            if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS and rid not in self.loads:
                self.loads.append(rid)
        req_ids = list(out.num_scheduled_tokens)
        # a token for each request whose prompt is done (none for a partial prefill chunk)
        sampled = [
            [7] if scheduler.requests[r].num_computed_tokens >= scheduler.requests[r].num_tokens
            else []
            for r in req_ids
        ]  # fmt: skip
        kv_output = (
            KVConnectorOutput(finished_recving=finished_recving) if finished_recving else None
        )
        if self.probe_dim is not None:
            prefilled = [
                r for r, s in zip(req_ids, sampled, strict=True)
                if s and not scheduler.requests[r].num_output_tokens
            ]  # fmt: skip
            vectors = {r: probe_vector(r, self.probe_dim) for r in prefilled}
            kv_output = kv_output or KVConnectorOutput()
            kv_output.kv_connector_worker_meta = LeapWorkerMetadata(vectors=vectors)
        result = scheduler.update_from_output(
            out,
            ModelRunnerOutput(
                req_ids=req_ids,
                sampled_token_ids=sampled,
                logprobs=None,
                prompt_logprobs_dict={},
                pooler_output=[],
                kv_connector_output=kv_output,
            ),
        )
        for engine_outputs in result.values():
            for output in engine_outputs.outputs:
                self.outputs.setdefault(output.request_id, []).extend(output.new_token_ids)
                if output.finish_reason is not None:
                    self.finished.append(output.request_id)

    def run(self, max_steps: int = 500, loaded_after: int = 1) -> None:
        """Step until idle; a load reports finished ``loaded_after`` steps after it started."""
        for n in range(max_steps):
            if not self.scheduler.has_requests():
                return
            due = {r for r, at in self._load_started.items() if n - at >= loaded_after}
            for rid in due:
                self._load_started[rid] = max_steps  # reported once
            self.step(finished_recving=due or None)
            for rid in self.loads:
                self._load_started.setdefault(rid, n)
        raise AssertionError(f"scheduler still busy after {max_steps} steps")


class RemotePrefillConnector(KVConnectorBase_V1):
    """P/D's shape of a KV-loading connector: a request flagged ``do_remote_prefill``
    loads its whole prompt asynchronously (vLLM's default ``may_load_async`` reads the
    same flag); the test reports the load done through ``finished_recving``. A
    flagged request whose remote holds nothing (``remote_empty``) loads nothing: the
    false positive ``may_load_async`` allows."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        params = request.kv_transfer_params or {}
        if not params.get("do_remote_prefill") or params.get("remote_empty"):
            return 0, False
        return len(request.prompt_token_ids) - num_computed_tokens, True

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        params = request.kv_transfer_params
        if params and num_external_tokens:
            params["do_remote_prefill"] = False  # loaded once

    def build_connector_meta(self, scheduler_output):
        return KVConnectorMetadata()

    def request_finished(self, request, block_ids):
        return False, None

    @property
    def requires_kv_delivery(self) -> bool:
        return False

    def start_load_kv(self, forward_context, **kwargs):
        pass

    def wait_for_layer_load(self, layer_name):
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        pass

    def wait_for_save(self):
        pass
