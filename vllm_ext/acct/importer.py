"""Worker-side import of converted KV into a paged cache, one layer at a time (no vLLM).

:class:`ImportStep` runs one engine step's imports. The source runs once per
request; then, layer by layer, every request's KV for that layer is converted
and handed to ``write`` — the connector passes the attention backend's own
cache-write op, so the page interior (ISA-specific on CPU, NHD on CUDA) is
never touched here. On CUDA all of it is enqueued on a side stream with one
event per layer, so the forward's layer ``j`` waits only for layer ``j``'s
import (:meth:`ImportStep.wait`) and nothing waits on the host. The online
check (:func:`vllm_ext.acct.gate.online_check`) and the timing read are left
to :meth:`ImportStep.finish`, which the connector calls after the forward,
where the step synchronises anyway.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from vllm_ext.acct.gate import online_check
from vllm_ext.acct.llama import KV
from vllm_ext.acct.pipeline import AcctPipeline

# write(layer index, key [tokens, kv_heads, head_dim], value, slot mapping [tokens])
LayerWrite = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None]
LOCAL_SINKS = 4


@dataclass(frozen=True)
class ImportJob:
    """Import tokens ``start..len(token_ids)`` of a request's prefix into its blocks."""

    req_id: str
    token_ids: tuple[int, ...]
    block_ids: tuple[int, ...]
    start: int

    @property
    def end(self) -> int:
        return len(self.token_ids)

    @property
    def tokens(self) -> int:
        return self.end - self.start

    def written_blocks(self, block_size: int) -> list[int]:
        return list(self.block_ids[self.start // block_size : self.end // block_size])


def to_device(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """Host ints to ``device``; from pinned memory on CUDA, so the host does not wait."""
    tensor = torch.tensor(values, dtype=torch.int64)
    if device.type == "cuda":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def slot_mapping(job: ImportJob, block_size: int, device: torch.device) -> torch.Tensor:
    blocks = to_device(job.block_ids, device)
    positions = torch.arange(job.start, job.end, device=device)
    return blocks[positions // block_size] * block_size + positions % block_size


@dataclass(frozen=True)
class CheckSettings:
    tokens: int
    max_gap: float


@dataclass
class StepResult:
    imported: list[ImportJob]
    gate_failed: list[ImportJob]
    errors: list[ImportJob]
    seconds: float


class ImportStep:
    """One step's imports; see the module docstring for the order of work."""

    def __init__(
        self,
        pipeline: AcctPipeline,
        jobs: Sequence[ImportJob],
        block_size: int,
        write: LayerWrite,
        cache_dtype: torch.dtype,
        check: CheckSettings | None,
    ):
        self.pipeline = pipeline
        self.jobs = list(jobs)
        self.block_size = block_size
        self.write = write
        self.cache_dtype = cache_dtype
        self.check = check if check is not None and check.tokens > 0 else None
        self.device = pipeline.target.embed_tokens.weight.device
        cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if cuda else None
        self.events: list = []
        self._timer = None
        if cuda:
            self._timer = tuple(torch.cuda.Event(enable_timing=True) for _ in range(2))
        self._cpu_seconds = 0.0
        self._ids: dict[str, torch.Tensor] = {}
        self._kv: dict[str, list[KV]] = {}
        self.errors: dict[str, BaseException] = {}
        self.verdicts: dict = {}

    def run(self) -> None:
        """Enqueue (CUDA) or do (CPU) every job's source run, conversion and writes."""
        started = time.perf_counter()
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            self._timer[0].record(self.stream)
        with torch.cuda.stream(self.stream) if self.stream is not None else nullcontext():
            self._run_jobs()
            if self._timer is not None:
                self._timer[1].record(self.stream)
        self._cpu_seconds = time.perf_counter() - started

    @torch.no_grad()
    def _run_jobs(self) -> None:
        states, slots = {}, {}
        for job in self.jobs:
            try:
                self._ids[job.req_id] = ids = to_device(job.token_ids, self.device)
                states[job.req_id] = self.pipeline.run_source(ids)
                slots[job.req_id] = slot_mapping(job, self.block_size, self.device)
            except Exception as exc:  # noqa: BLE001 - reported as a load error, vLLM recomputes
                self.errors[job.req_id] = exc
        live = [job for job in self.jobs if job.req_id not in self.errors]
        for layer in range(self.pipeline.num_layers):
            for job in live:
                if job.req_id in self.errors:
                    continue
                try:
                    self._write_layer(job, layer, states[job.req_id], slots[job.req_id])
                except Exception as exc:  # noqa: BLE001
                    self.errors[job.req_id] = exc
            if self.stream is not None:
                event = torch.cuda.Event()
                event.record(self.stream)
                self.events.append(event)

    def _write_layer(self, job: ImportJob, layer: int, state, slots: torch.Tensor) -> None:
        key, value = self.pipeline.convert_layer(state, layer)
        if self.check is not None:
            # the online check needs the whole imported cache; freed in finish()
            self._kv.setdefault(job.req_id, []).append((key, value))
        key = key[:, job.start :].transpose(0, 1).to(self.cache_dtype).contiguous()
        value = value[:, job.start :].transpose(0, 1).to(self.cache_dtype).contiguous()
        self.write(layer, key, value, slots)

    def wait(self, layer: int) -> None:
        """Make the current stream wait until ``layer`` is imported (no-op on CPU)."""
        if self.events:
            torch.cuda.current_stream(self.device).wait_event(self.events[layer])

    def finish(self) -> StepResult:
        """After the forward: the online check, the time spent, what failed."""
        seconds = self._cpu_seconds
        if self._timer is not None:
            self._timer[1].synchronize()
            seconds = self._timer[0].elapsed_time(self._timer[1]) / 1000.0
        gate_failed = []
        with torch.cuda.stream(self.stream) if self.stream is not None else nullcontext():
            for job in self.jobs:
                if job.req_id in self.errors or self.check is None:
                    continue
                try:
                    if not self._passes(job):
                        gate_failed.append(job)
                except Exception as exc:  # noqa: BLE001 - a check that cannot run rejects
                    self.errors[job.req_id] = exc
        self._kv.clear()
        self._ids.clear()
        errors = [job for job in self.jobs if job.req_id in self.errors]
        bad = {job.req_id for job in gate_failed + errors}
        imported = [job for job in self.jobs if job.req_id not in bad]
        return StepResult(imported, gate_failed, errors, seconds)

    def _passes(self, job: ImportJob) -> bool:
        sinks = self.pipeline.sink_tokens or LOCAL_SINKS
        verdict = online_check(
            self.pipeline.target, self._kv[job.req_id], self._ids[job.req_id],
            self.check.tokens, sinks, self.check.max_gap,
        )  # fmt: skip
        self.verdicts[job.req_id] = verdict
        return verdict.passed
