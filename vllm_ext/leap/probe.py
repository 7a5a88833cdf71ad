"""Worker side of LEAP: capture layer L's hidden state at the end of each prompt.

Runs in the vLLM worker process. A forward hook on decoder layer L copies the
layer's residual-stream output (``hidden + residual``) for the whole batch into
a preallocated buffer; it does nothing else, so it survives ``torch.compile``
when installed at load time (a hook added after compilation never fires).
After the forward pass, :meth:`ProbeState.collect` maps buffer rows to requests
with the model runner's batch layout (vLLM 0.32 V1 runner: ``input_batch``,
``query_start_loc``) and returns one vector per request whose last prompt
token was computed in this step, all copied to the host in one transfer.
Chunked prefill, prefix-cache hits (the first computed chunk starts past the
cached tokens) and preemption (the prompt is recomputed and the vector
re-sent) fall out of that mapping.

With ``refine_every = k > 0`` :meth:`ProbeState.collect` also returns,
every k output tokens, the same layer's state at the decoding token: the
remaining-length refinement (TRAIL-style) reads it from the same buffer.
"""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np
import torch

from vllm_ext.common.log import get_logger

logger = get_logger(__name__)


class ProbeError(RuntimeError):
    """The probe cannot be installed on this model or runner."""


def find_calling_runner(max_depth: int = 12) -> Any:
    """The model runner whose ``load_model`` is (indirectly) calling us.

    vLLM 0.32 hands model loaders no reference to the runner; the V1 runner
    calls ``get_model()`` → ``loader.load_model()`` from its own ``load_model``,
    so the runner is ``self`` in a calling frame.
    """
    frame = inspect.currentframe()
    for _ in range(max_depth):
        frame = frame.f_back if frame else None
        if frame is None:
            break
        candidate = frame.f_locals.get("self")
        if hasattr(candidate, "input_batch") and hasattr(candidate, "query_start_loc"):
            return candidate
    raise ProbeError(
        "LEAP needs vLLM's V1 model runner (input_batch/query_start_loc); set "
        "VLLM_USE_V2_MODEL_RUNNER=0 (vllm-ext serve --plugins leap does this)"
    )


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
    """

    def __init__(
        self, layer: int, pooling: str, hidden_size: int, max_tokens: int, refine_every: int = 0
    ):
        self.layer = layer
        self.refine_every = refine_every
        self.pooling = pooling
        self.hidden_size = hidden_size
        self.max_tokens = max_tokens
        self.buffer = torch.zeros(0, hidden_size)
        self.rows_written = 0
        self.runner: Any = None
        self._sums: dict[str, tuple[torch.Tensor, int]] = {}

    def hook(self, module, args, output) -> None:
        # vLLM decoder layers return (hidden_states, residual); the residual
        # stream after layer L is their sum
        hidden, residual = output if isinstance(output, tuple) else (output, None)
        state = hidden if residual is None else hidden + residual
        n = state.shape[0]
        self.buffer[:n].copy_(state)
        self.rows_written = n

    def install(self, model: torch.nn.Module, runner: Any) -> None:
        layers = decoder_layers(model)
        if not 0 <= self.layer < len(layers):
            raise ProbeError(f"probe layer {self.layer} out of range 0..{len(layers) - 1}")
        # on the model's device, allocated before compilation/graph capture
        device = next(model.parameters()).device
        self.buffer = torch.zeros(
            self.max_tokens, self.hidden_size, dtype=torch.float32, device=device
        )
        layers[self.layer].register_forward_hook(self.hook)
        self.runner = runner
        logger.info("LEAP probe on decoder layer %d (%s pooling)", self.layer, self.pooling)

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
        """
        batch = self.runner.input_batch
        n = batch.num_reqs
        # vectorised scan: a decode step of a large batch has no per-request Python work
        starts = self.runner.query_start_loc.cpu[: n + 1].numpy()
        computed = np.asarray(batch.num_computed_tokens_cpu[:n], dtype=np.int64)
        prompt = np.asarray(batch.num_prompt_tokens[:n], dtype=np.int64)
        first, end = starts[:-1], starts[1:]
        captured = end <= self.rows_written
        prefilling = np.flatnonzero(captured & (computed < prompt))
        generated = computed - prompt + 1
        due = np.zeros(n, dtype=bool)
        if self.refine_every:
            due = captured & (end - first == 1) & (generated > 0)
            due &= generated % self.refine_every == 0
        prompt_ids, decode_ids, generated_at, rows = [], [], [], []
        for i in prefilling.tolist():
            upto = min(int(prompt[i]), int(computed[i] + end[i] - first[i]))
            req_id = batch.req_ids[i]
            vector = self._pool(req_id, int(first[i]), int(computed[i]), upto, int(prompt[i]))
            if vector is not None:
                prompt_ids.append(req_id)
                rows.append(vector)
        for i in np.flatnonzero(due).tolist():
            decode_ids.append(batch.req_ids[i])
            generated_at.append(int(generated[i]))
            rows.append(self.buffer[int(first[i])])
        if not rows:
            return {}, {}
        # one device -> host copy (one sync on an accelerator) for the whole step
        host = torch.stack(rows).float().cpu().numpy()
        decode_rows = host[len(prompt_ids) :]
        prompt_vectors = dict(zip(prompt_ids, host, strict=False))
        decode_vectors = {
            req_id: (generated, vector)
            for req_id, generated, vector in zip(decode_ids, generated_at, decode_rows, strict=True)
        }
        return prompt_vectors, decode_vectors

    def _pool(self, req_id: str, first_row: int, computed: int, upto: int, prompt: int):
        # prompt positions [computed, upto) sit at rows first_row + (pos - computed)
        ends_here = upto == prompt
        if self.pooling == "last":
            return self.buffer[first_row + prompt - 1 - computed] if ends_here else None
        rows = self.buffer[first_row : first_row + upto - computed]
        if computed == 0 or req_id not in self._sums:
            self._sums[req_id] = (torch.zeros_like(rows[0]), 0)
        total, count = self._sums[req_id]
        total, count = total + rows.sum(dim=0), count + rows.shape[0]
        if not ends_here:
            self._sums[req_id] = (total, count)
            return None
        self._sums.pop(req_id, None)
        return total / count

    def forget(self, req_ids) -> None:
        """Drop partial mean-pooling sums of finished or aborted requests."""
        for req_id in req_ids:
            self._sums.pop(req_id, None)
