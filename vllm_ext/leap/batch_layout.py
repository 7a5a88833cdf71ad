"""Each step's row -> request mapping for the LEAP probe, from either vLLM model runner.

Two :class:`~vllm_ext.leap.probe.LayoutSource` adapters (vLLM 0.32-0.34):

- :class:`V2StepLayout` (Model Runner V2, the only runner from vLLM 0.34 on;
  read against 0.34's ``vllm/v1/worker/gpu/``): ``ActiveKVConnector`` calls the
  worker connector's ``start_load_kv(forward_context, scheduler_output=...,
  request_ids=..., num_tokens=...)`` once per step with a forward (before it
  when the step has synchronous KV loads, else right after it) and always
  before ``build_connector_worker_meta``. ``request_ids`` is
  ``InputBatch.req_ids``, the batch's row order (``sort_batch_req_ids``:
  draft-verifying and decode requests first, not the scheduler's order); each
  request's rows are contiguous (``query_start_loc`` is the cumulative sum of
  the scheduled tokens in that order) and CUDA-graph / data-parallel padding
  rows follow ``num_tokens``. So the layout follows from those kwargs alone,
  with no runner internals and no device tensor (``request_state_indices`` is
  one; it is not read). One exception: adaptive draft verification trims the
  drafts of the leading, verifying requests on the device only; the host then
  knows the rows of every request after them (they end at ``num_tokens``) but
  not theirs, and those are marked unknown.
- :class:`V1RunnerLayout` (the V1 runner, which the CPU build of vLLM 0.32 and
  0.33 uses): V1's ``start_load_kv`` gets no request ids, so the layout is read
  from the runner's persistent batch (``input_batch``, ``query_start_loc``);
  the runner is handed over explicitly by the loader and type-checked here.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from vllm.v1.core.sched.output import SchedulerOutput

from vllm_ext.common.compat import check_instance
from vllm_ext.leap.probe import BatchLayout, ProbeError, RunnerSliceLayout


def _prompt_tokens(new_request) -> int:
    """Prompt length of a ``NewRequestData`` (token ids, or embeddings)."""
    if new_request.prompt_token_ids is not None:
        return len(new_request.prompt_token_ids)
    embeds = getattr(new_request, "prompt_embeds", None)
    if embeds is None:
        raise ProbeError(f"request {new_request.req_id} has neither prompt tokens nor embeddings")
    return int(embeds.shape[0])


def _after_trimmed_drafts(ids, counts, drafts, num_tokens):
    """Row starts when the device trimmed the drafts of the leading, verifying requests.

    Model Runner V2's adaptive verification keeps those requests first and
    gives them ``num_tokens`` minus the other requests' tokens in all; how it
    splits them is known on the device only. Returns ``(starts, known)``.
    """
    verifying = np.array([bool(drafts.get(r)) for r in ids], dtype=bool)
    leading = int(verifying.sum())
    tail = counts[leading:]
    if leading == 0 or not verifying[:leading].all() or num_tokens > counts.sum():
        raise ProbeError(
            f"Model Runner V2 computed {num_tokens} rows for {int(counts.sum())} scheduled "
            "tokens, and not by trimming the drafts of its leading requests"
        )
    starts = np.zeros(len(ids) + 1, dtype=np.int64)
    # the verifying requests' own bounds are unknown (left at 0); none is read
    starts[leading] = num_tokens - int(tail.sum())
    starts[leading + 1 :] = starts[leading] + np.cumsum(tail)
    return starts, ~verifying


class V2StepLayout:
    """The layout of the step Model Runner V2 announced through ``start_load_kv``."""

    def __init__(self):
        self._prompt: dict[str, int] = {}  # scheduled requests' prompt lengths, until finished
        self._pending: BatchLayout | None = None

    def observe(self, scheduler_output, request_ids, num_tokens: int | None = None) -> None:
        """Record this step's rows from ``start_load_kv``'s kwargs.

        Args:
            scheduler_output: the step's ``SchedulerOutput``.
            request_ids: ``InputBatch.req_ids``, in row order.
            num_tokens: ``InputBatch.num_tokens``, the rows that hold tokens
                (padding follows); None: the scheduled tokens' sum.
        """
        if not isinstance(scheduler_output, SchedulerOutput):
            raise ProbeError(
                f"start_load_kv's scheduler_output is a {type(scheduler_output).__name__}, "
                "not vLLM's SchedulerOutput"
            )
        ids = list(request_ids)
        if not all(isinstance(r, str) for r in ids):
            raise ProbeError("start_load_kv's request_ids are not request id strings")
        computed: dict[str, int] = {}
        # a resumed (preempted) request is re-sent in full, like a new one
        for new in scheduler_output.scheduled_new_reqs:
            self._prompt[new.req_id] = _prompt_tokens(new)
            computed[new.req_id] = new.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        scheduled = scheduler_output.num_scheduled_tokens
        counts = np.array([scheduled[r] for r in ids], dtype=np.int64)
        starts = np.zeros(len(ids) + 1, dtype=np.int64)
        np.cumsum(counts, out=starts[1:])
        written = int(starts[-1]) if num_tokens is None else int(num_tokens)
        known = None
        if written != starts[-1]:
            starts, known = _after_trimmed_drafts(
                ids, counts, scheduler_output.scheduled_spec_decode_tokens, written
            )
        self._pending = BatchLayout(
            req_ids=ids,
            starts=starts,
            computed=np.array([computed[r] for r in ids], dtype=np.int64),
            prompt=np.array([self._prompt_of(r) for r in ids], dtype=np.int64),
            written=written,
            known=known,
        )

    def _prompt_of(self, req_id: str) -> int:
        try:
            return self._prompt[req_id]
        except KeyError:
            raise ProbeError(
                f"request {req_id} runs in Model Runner V2's batch but was never scheduled "
                "as new (its prompt length is unknown)"
            ) from None

    def layout(self) -> BatchLayout | None:
        """The announced step's layout, once (None when no step was announced)."""
        layout, self._pending = self._pending, None
        return layout

    def forget(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            self._prompt.pop(req_id, None)


class V1RunnerLayout(RunnerSliceLayout):
    """The layout of the step a V1 model runner just computed, read from its batch."""

    def __init__(self, runner):
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        if not isinstance(runner, GPUModelRunner):
            raise ProbeError(
                f"LEAP's V1 probe needs vLLM's V1 GPUModelRunner (or CPUModelRunner), "
                f"got {type(runner).__name__}"
            )
        check_instance("leap", runner, "GPUModelRunner")
        super().__init__(runner)
