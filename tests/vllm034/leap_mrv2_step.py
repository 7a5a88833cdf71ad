"""One Model Runner V2 step of vLLM 0.34, run on CPU as far as 0.34's own code runs there.

Real: the ``SchedulerOutput`` (0.34's ``Scheduler``), the worker's
``RequestState`` (``vllm/v1/worker/gpu/states.py``; built on CPU, where vLLM
itself falls back to non-UVA buffers), the batch order and counts
(``GPUModelRunner.gather_batch_req_state``), the ``InputBatch``
(``GPUModelRunner.prepare_inputs``: ``req_ids``, ``query_start_loc_np``,
``idx_mapping``, padding to ``num_tokens_after_padding``) and the connector
calls (``ActiveKVConnector.pre_forward`` / ``post_forward``, which build
``start_load_kv``'s kwargs and ask for the worker metadata after it). Stand-ins,
because they are Triton kernels: the three input kernels ``prepare_inputs``
launches, replaced by the loops they compute (token ids and positions of each
row from ``query_start_loc`` and ``idx_mapping``), and ``apply_staged_writes``
(the token table is kept here). Helpers only; the assertions are in the test.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch
from vllm.v1.worker.gpu import buffer_utils
from vllm.v1.worker.gpu import model_runner as mrv2
from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor
from vllm.v1.worker.gpu.input_batch import InputBuffers
from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector
from vllm.v1.worker.gpu.states import RequestState

CPU = torch.device("cpu")


class Mrv2Rows:
    """The worker half of MRV2's request bookkeeping and input preparation, for one engine."""

    def __init__(self, vllm_config, max_num_reqs: int, max_tokens: int, monkeypatch):
        # no UVA on CPU: vLLM's own fallback (plain host tensors) is taken
        monkeypatch.setattr(buffer_utils, "is_uva_available", lambda: False)
        monkeypatch.setattr(mrv2, "prepare_prefill_inputs", self._prefill_inputs)
        monkeypatch.setattr(mrv2, "prepare_pos_seq_lens", self._pos_seq_lens)
        monkeypatch.setattr(mrv2, "combine_sampled_and_draft_tokens", self._logits_indices)
        self.max_tokens = max_tokens
        self.req_states = RequestState(
            max_num_reqs, vllm_config.model_config.max_model_len, max_tokens, 0, 1000, CPU
        )
        self.tokens: dict[int, list[int]] = {}  # req_state index -> prefill token ids
        # the attributes of GPUModelRunner that gather_batch_req_state / prepare_inputs read
        self.runner = SimpleNamespace(
            req_states=self.req_states,
            decode_query_len=1,
            use_pp=False,
            adaptive_verification=None,
            pcp_manager=None,
            fast_prefill=None,
            device=CPU,
            max_num_reqs=max_num_reqs,
            input_buffers=InputBuffers(max_num_reqs, max_tokens, CPU),
            model_state=SimpleNamespace(num_new_sampled_tokens_per_step=1),
            model_config=SimpleNamespace(rswa_window=None),
        )

    def update(self, scheduler_output) -> None:
        """``finish_requests`` / ``add_requests`` / ``update_requests``, request state only."""
        states = self.req_states
        gone = set(scheduler_output.finished_req_ids) | set(
            scheduler_output.preempted_req_ids or ()
        )
        for req_id in gone:
            states.remove_request(req_id)
        for new in scheduler_output.scheduled_new_reqs:
            states.remove_request(new.req_id)
            states.add_request(
                new.req_id, new.prompt_len, new.prefill_token_ids, new.num_computed_tokens, 1
            )
            self.tokens[states.req_id_to_index[new.req_id]] = list(new.prefill_token_ids)
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, computed in zip(cached.req_ids, cached.num_computed_tokens, strict=True):
            states.num_computed_tokens_np[states.req_id_to_index[req_id]] = computed
        np.minimum(
            states.num_computed_tokens_np,
            states.prefill_len.np,
            out=states.num_computed_prefill_tokens,
        )

    def append_output(self, req_id: str, token: int) -> None:
        """A sampled token joins the request's tokens (MRV2 keeps them on the device)."""
        self.tokens[self.req_states.req_id_to_index[req_id]].append(token)

    def input_batch(self, scheduler_output, padded_tokens: int):
        """0.34's ``InputBatch`` for this step, padded to ``padded_tokens`` rows."""
        runner = mrv2.GPUModelRunner
        state, _ = runner.gather_batch_req_state(self.runner, scheduler_output, False)
        desc = BatchExecutionDescriptor(
            cg_mode=mrv2.CUDAGraphMode.PIECEWISE, num_tokens=padded_tokens, num_reqs=None
        )
        return runner.prepare_inputs(self.runner, scheduler_output, state, desc, 0)

    # ---- the Triton kernels prepare_inputs launches, as the loops they compute
    def _rows(self, idx_mapping, query_start_loc):
        starts = query_start_loc.tolist()
        for i, index in enumerate(idx_mapping.tolist()):
            yield index, starts[i], starts[i + 1]

    def _prefill_inputs(self, input_ids, next_prefill, idx_mapping, qsl, *_):
        self._token_ids(input_ids, idx_mapping, qsl)

    def _token_ids(self, input_ids, idx_mapping, qsl):
        computed = self.req_states.num_computed_tokens_np
        for index, start, end in self._rows(idx_mapping, qsl):
            tokens = self.tokens[index]
            for row in range(start, end):
                position = int(computed[index]) + row - start
                if position < len(tokens):
                    input_ids[row] = tokens[position]

    def _pos_seq_lens(self, idx_mapping, qsl, num_computed, positions, seq_lens):
        computed = self.req_states.num_computed_tokens_np
        for i, (index, start, end) in enumerate(self._rows(idx_mapping, qsl)):
            for row in range(start, end):
                positions[row] = int(computed[index]) + row - start
            seq_lens[i] = int(computed[index]) + end - start

    def _logits_indices(self, input_ids, idx_mapping, last, qsl, *args, **kwargs):
        # decode rows read the last sampled token; it is already in self.tokens
        self._token_ids(input_ids, idx_mapping, qsl)
        return qsl[1 : idx_mapping.shape[0] + 1] - 1


def active_kv_connector(vllm_config, worker_connector) -> ActiveKVConnector:
    """0.34's ``ActiveKVConnector`` around ``worker_connector``.

    Its ``__init__`` takes the connector from vLLM's process-wide transfer
    group and registers KV caches (there are none here); the rest is 0.34's.
    """
    active = object.__new__(ActiveKVConnector)
    active.vllm_config = vllm_config
    active.kv_connector = worker_connector
    active._pending_load_kwargs = None
    active._disabled = False
    return active
