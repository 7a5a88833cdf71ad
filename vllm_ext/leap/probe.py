"""Worker side of LEAP: capture layer L's hidden state at the end of each prompt.

Runs in the vLLM worker process. A forward hook on decoder layer L copies the
layer's residual-stream output (``hidden + residual``) for the whole batch into
a preallocated buffer; it does nothing else, so it survives ``torch.compile``
when installed at load time (a hook added after compilation never fires).
After the forward pass, :meth:`ProbeState.collect` maps buffer rows to requests
with the model runner's batch layout (vLLM 0.32 V1 runner: ``input_batch``,
``query_start_loc``) and returns one vector per request whose last prompt
token was computed in this step. Chunked prefill, prefix-cache hits (the first
computed chunk starts past the cached tokens) and preemption (the prompt is
recomputed and the vector re-sent) fall out of that mapping.

With ``refine_every = k > 0`` :meth:`ProbeState.collect_decode` also returns,
every k output tokens, the same layer's state at the decoding token: the
remaining-length refinement (TRAIL-style) reads it from the same buffer.
"""

from __future__ import annotations

import inspect
from typing import Any

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

    def collect(self) -> dict[str, list[float]]:
        """Vectors of requests whose prompt ended in the step just computed."""
        batch = self.runner.input_batch
        n = batch.num_reqs
        starts = self.runner.query_start_loc.cpu[: n + 1].tolist()
        out: dict[str, list[float]] = {}
        for i, req_id in enumerate(batch.req_ids[:n]):
            computed = int(batch.num_computed_tokens_cpu[i])
            prompt = int(batch.num_prompt_tokens[i])
            first, end = starts[i], starts[i + 1]
            if computed >= prompt or end > self.rows_written:
                continue  # decoding, or rows not captured
            vector = self._pool(
                req_id, first, computed, min(prompt, computed + end - first), prompt
            )
            if vector is not None:
                out[req_id] = vector.cpu().tolist()
        return out

    def collect_decode(self) -> dict[str, tuple[int, list[float]]]:
        """``{req_id: (generated, vector)}`` of decoding requests at a multiple of ``refine_every``.

        ``generated`` counts the output tokens known when the vector was
        computed (the decoding input is the latest of them). Multi-token
        steps (prefill, a resumed request's recompute) are skipped.
        """
        if not self.refine_every:
            return {}
        batch = self.runner.input_batch
        n = batch.num_reqs
        starts = self.runner.query_start_loc.cpu[: n + 1].tolist()
        out: dict[str, tuple[int, list[float]]] = {}
        for i, req_id in enumerate(batch.req_ids[:n]):
            first, end = starts[i], starts[i + 1]
            generated = int(batch.num_computed_tokens_cpu[i]) - int(batch.num_prompt_tokens[i]) + 1
            if end - first != 1 or end > self.rows_written or generated <= 0:
                continue
            if generated % self.refine_every == 0:
                out[req_id] = (generated, self.buffer[first].cpu().tolist())
        return out

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
