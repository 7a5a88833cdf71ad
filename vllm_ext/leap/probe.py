"""Worker side of LEAP: capture layer L's hidden state at the end of each prompt.

Runs in the vLLM worker process. A forward hook on decoder layer L copies the
layer's residual-stream output (``hidden + residual``) for the whole batch into
a preallocated buffer; it does nothing else, so it survives ``torch.compile``
when installed at load time (a hook added after compilation never fires).
After the forward pass, :meth:`ProbeState.collect` maps buffer rows to requests
with the step's :class:`~vllm_ext.leap.batch_layout.BatchLayout` (Model Runner
V2: handed over by the connector's ``start_load_kv``; V1 runner: read from the
runner bound at load time) and returns one vector per request whose last prompt
token was computed in this step, all copied to the host in one transfer.
Chunked prefill, prefix-cache hits (the first computed chunk starts past the
cached tokens) and preemption (the prompt is recomputed and the vector
re-sent) fall out of that mapping.

Under tensor parallelism every rank's hook sees the whole hidden state: the
layer's row-parallel projections all-reduce before the layer returns. Each
rank sends the same vectors; ``LeapWorkerMetadata.aggregate`` keeps one per
request (tested at TP=2 against TP=1: ``tests/engine/test_leap_tp2.py``).

With ``refine_every = k > 0`` :meth:`ProbeState.collect` also returns,
every k output tokens, the same layer's state at the decoding token: the
remaining-length refinement (TRAIL-style) reads it from the same buffer.

Deferred delivery (``deferred=True``, LEAP's default on CUDA): vLLM asks for
the worker metadata while the step is still on the device (the V1 runner right
after it launches the forward; Model Runner V2 after it launches sampling,
before any drafter). A blocking device-to-host copy there makes the host wait,
so the next kernels launch late and, under async scheduling, the next step's
scheduling no longer overlaps this step's compute. Deferred, the step's
vectors go to a pinned host buffer with a non-blocking copy on a side stream
(ordered after the forward's stream) and an event, and the *next* call
returns them: by then that copy has long finished, so nothing waits.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from vllm_ext.common.log import get_logger

logger = get_logger(__name__)


class ProbeError(RuntimeError):
    """The probe cannot be installed on this model or runner."""


@dataclass(frozen=True)
class BatchLayout:
    """Which buffer rows belong to which request in one step.

    ``starts[i]:starts[i + 1]`` are the rows of request ``req_ids[i]``, whose
    first ``computed[i]`` tokens were computed before this step and whose
    prompt has ``prompt[i]`` tokens. ``written``: rows the forward wrote, when
    the layout's source knows (Model Runner V2); else the hook counts them.
    ``known``: False where the source cannot place a request's rows (Model
    Runner V2's adaptive draft verification moves them on the device only);
    None when every request's rows are known.
    """

    req_ids: Sequence[str]
    starts: np.ndarray
    computed: np.ndarray
    prompt: np.ndarray
    written: int | None = None
    known: np.ndarray | None = None


class RunnerSliceLayout:
    """The layout read from a V1 model runner's batch (``input_batch``, ``query_start_loc``).

    vLLM-free: :class:`~vllm_ext.leap.batch_layout.V1RunnerLayout` type-checks
    the runner first; tests and ``benchmarks/leap/gpu_probe.py`` pass the same
    slice built by hand.
    """

    def __init__(self, runner: Any):
        self.runner = runner

    def layout(self) -> BatchLayout:
        batch = self.runner.input_batch
        n = batch.num_reqs
        return BatchLayout(
            req_ids=batch.req_ids[:n],
            starts=np.asarray(self.runner.query_start_loc.cpu[: n + 1], dtype=np.int64),
            computed=np.asarray(batch.num_computed_tokens_cpu[:n], dtype=np.int64),
            prompt=np.asarray(batch.num_prompt_tokens[:n], dtype=np.int64),
        )

    def forget(self, req_ids: Iterable[str]) -> None:
        pass


class LayoutSource(Protocol):
    """Where a probe gets each step's :class:`BatchLayout` (:mod:`~vllm_ext.leap.batch_layout`)."""

    def layout(self) -> BatchLayout | None: ...

    def forget(self, req_ids: Iterable[str]) -> None: ...


def decoder_layers(model: torch.nn.Module) -> Any:
    """``model.model.layers`` of a vLLM decoder model (Llama, Qwen, Qwen3-Next, ...)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ProbeError(f"{type(model).__name__} has no model.layers to probe")
    return layers


class ProbeState:
    """Per-worker capture buffer, hook and row → request mapping.

    Args:
        layer: index of the probed decoder layer.
        pooling: ``"last"`` (last prompt token) or ``"mean"`` (mean over the
            prompt tokens this engine computed; cached prefix tokens are skipped).
        hidden_size: model hidden size.
        max_tokens: rows of the buffer (the step's token budget).
        deferred: :meth:`collect` returns the previous step's vectors and copies
            this step's without waiting for the device (see the module docstring).
    """

    def __init__(
        self,
        layer: int,
        pooling: str,
        hidden_size: int,
        max_tokens: int,
        refine_every: int = 0,
        deferred: bool = False,
    ):
        self.layer = layer
        self.refine_every = refine_every
        self.pooling = pooling
        self.hidden_size = hidden_size
        self.max_tokens = max_tokens
        self.deferred = deferred
        self.buffer = torch.zeros(0, hidden_size)
        self.rows_written = 0
        self._source: LayoutSource | None = None
        # mean pooling: req_id -> (sum, rows, the prompt position the sum ends at)
        self._sums: dict[str, tuple[torch.Tensor, int, int]] = {}
        # deferred delivery: the last step's rows on their way to the host
        self._pending: _PendingCopy | None = None
        self._staging: torch.Tensor | None = None  # pinned, grown on demand
        self._copy_stream = None  # CUDA only: the stream of that copy

    def hook(self, module, args, output) -> None:
        # vLLM decoder layers return (hidden_states, residual); the residual
        # stream after layer L is their sum
        hidden, residual = output if isinstance(output, tuple) else (output, None)
        state = hidden if residual is None else hidden + residual
        n = state.shape[0]
        self.buffer[:n].copy_(state)
        self.rows_written = n

    def install(self, model: torch.nn.Module) -> None:
        layers = decoder_layers(model)
        if not 0 <= self.layer < len(layers):
            raise ProbeError(f"probe layer {self.layer} out of range 0..{len(layers) - 1}")
        # on the model's device, allocated before compilation/graph capture
        device = next(model.parameters()).device
        self.buffer = torch.zeros(
            self.max_tokens, self.hidden_size, dtype=torch.float32, device=device
        )
        layers[self.layer].register_forward_hook(self.hook)
        logger.info("LEAP probe on decoder layer %d (%s pooling)", self.layer, self.pooling)

    def bind_layout(self, source: LayoutSource) -> None:
        """Take each step's row -> request mapping from ``source``."""
        self._source = source

    @property
    def runner(self) -> Any:
        return getattr(self._source, "runner", None)

    @runner.setter
    def runner(self, runner: Any) -> None:
        """Bind a V1 runner slice as the layout source (see :class:`RunnerSliceLayout`)."""
        self.bind_layout(RunnerSliceLayout(runner))

    def _layout(self) -> BatchLayout | None:
        if self._source is None:
            raise ProbeError("LEAP probe has no batch layout source (loader did not bind one)")
        return self._source.layout()

    def collect(self) -> tuple[dict[str, Any], dict[str, tuple[int, Any]]]:
        """Vectors of the step just computed: ``(prompt_vectors, decode_vectors)``.

        ``prompt_vectors``: ``{req_id: vector}`` of requests whose prompt ended
        in this step. ``decode_vectors`` (only with ``refine_every``):
        ``{req_id: (generated, vector)}`` of single-token decode steps at a
        multiple of ``refine_every``; ``generated`` counts the output tokens
        known when the vector was computed (the decoding input is the latest of
        them). Multi-token steps past the prompt (a resumed request's
        recompute) give neither. Vectors are float32 numpy rows of one array:
        they leave the device in one copy, with no per-float Python conversion.
        With ``deferred`` these are the previous call's step's vectors.
        """
        layout = self._layout()
        step = self._gather(layout) if layout is not None else _StepRows()
        if not self.deferred:
            if step.rows is None:
                return {}, {}
            # one device -> host copy (one sync on an accelerator) for the whole step
            return step.unpack(step.rows.float().cpu().numpy())
        ready = self._pending.unpack() if self._pending is not None else ({}, {})
        self._pending = self._start_copy(step) if step.rows is not None else None
        return ready

    def _gather(self, layout: BatchLayout) -> _StepRows:
        """This step's probe rows on the device and whom they belong to."""
        n = len(layout.req_ids)
        # vectorised scan: a decode step of a large batch has no per-request Python work
        starts, computed, prompt = layout.starts, layout.computed, layout.prompt
        first, end = starts[:-1], starts[1:]
        written = self.rows_written if layout.written is None else layout.written
        captured = end <= written
        if layout.known is not None:
            captured &= layout.known
        prefilling = np.flatnonzero(captured & (computed < prompt))
        generated = computed - prompt + 1
        due = np.zeros(n, dtype=bool)
        if self.refine_every:
            due = captured & (end - first == 1) & (generated > 0)
            due &= generated % self.refine_every == 0
        step = _StepRows()
        rows = []
        for i in prefilling.tolist():
            upto = min(int(prompt[i]), int(computed[i] + end[i] - first[i]))
            req_id = layout.req_ids[i]
            vector = self._pool(req_id, int(first[i]), int(computed[i]), upto, int(prompt[i]))
            if vector is not None:
                step.prompt_ids.append(req_id)
                rows.append(vector)
        for i in np.flatnonzero(due).tolist():
            step.decode_ids.append(layout.req_ids[i])
            step.generated_at.append(int(generated[i]))
            rows.append(self.buffer[int(first[i])])
        step.rows = torch.stack(rows) if rows else None
        return step

    def _start_copy(self, step: _StepRows) -> _PendingCopy:
        """This step's rows to host memory without waiting for the device."""
        rows = step.rows.float()
        if rows.device.type != "cuda":  # no stream to overlap with: a plain copy
            return _PendingCopy(step, rows.cpu().clone(), None)
        n = rows.shape[0]
        if self._staging is None or self._staging.shape[0] < n:
            # pinned, so the copy is truly asynchronous; grown in powers of two
            size = 1 << max(n - 1, 1).bit_length()
            self._staging = torch.empty(size, rows.shape[1], dtype=torch.float32, pin_memory=True)
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(rows.device)
        host = self._staging[:n]
        # the rows are computed on the forward's stream: the copy waits for them
        # there, and runs beside the next step's kernels instead of behind them
        producer = torch.cuda.current_stream(rows.device)
        self._copy_stream.wait_stream(producer)
        with torch.cuda.stream(self._copy_stream):
            host.copy_(rows, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        # the allocator must not hand ``rows`` to the producer until the copy read it
        rows.record_stream(self._copy_stream)
        return _PendingCopy(step, host, event)

    def _pool(self, req_id: str, first_row: int, computed: int, upto: int, prompt: int):
        # prompt positions [computed, upto) sit at rows first_row + (pos - computed)
        ends_here = upto == prompt
        if self.pooling == "last":
            return self.buffer[first_row + prompt - 1 - computed] if ends_here else None
        rows = self.buffer[first_row : first_row + upto - computed]
        total, count, end = self._sums.get(req_id, (None, 0, -1))
        if end != computed:
            # a new prompt, or one recomputed after preemption (from a prefix hit, or
            # from 0): the partial sum of the earlier pass would count positions twice
            total, count = torch.zeros_like(rows[0]), 0
        total, count = total + rows.sum(dim=0), count + rows.shape[0]
        if not ends_here:
            self._sums[req_id] = (total, count, upto)
            return None
        self._sums.pop(req_id, None)
        return total / count

    def forget(self, req_ids) -> None:
        """Drop partial mean-pooling sums of finished or aborted requests."""
        for req_id in req_ids:
            self._sums.pop(req_id, None)
        if self._source is not None:
            self._source.forget(req_ids)


class _StepRows:
    """One step's probe rows (stacked on the device) and the requests they belong to."""

    def __init__(self):
        self.prompt_ids: list[str] = []
        self.decode_ids: list[str] = []
        self.generated_at: list[int] = []
        self.rows: torch.Tensor | None = None

    def unpack(self, host: np.ndarray) -> tuple[dict[str, Any], dict[str, tuple[int, Any]]]:
        """``(prompt_vectors, decode_vectors)`` from the rows copied to ``host``."""
        decode_rows = host[len(self.prompt_ids) :]
        prompt_vectors = dict(zip(self.prompt_ids, host, strict=False))
        decode_vectors = {
            req_id: (generated, vector)
            for req_id, generated, vector in zip(
                self.decode_ids, self.generated_at, decode_rows, strict=True
            )
        }
        return prompt_vectors, decode_vectors


class _PendingCopy:
    """A step's rows on their way to host memory (``event`` marks the copy's end)."""

    def __init__(self, step: _StepRows, host: torch.Tensor, event):
        self.step, self.host, self.event = step, host, event

    def unpack(self) -> tuple[dict[str, Any], dict[str, tuple[int, Any]]]:
        if self.event is not None:
            self.event.synchronize()  # enqueued a step ago: done by now, in practice
        # own memory: the pinned staging buffer is reused by the next copy
        return self.step.unpack(self.host.numpy().copy())
