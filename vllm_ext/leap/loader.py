"""``--load-format leap``: the load format the user asked for, plus the LEAP probe.

Wraps any registered vLLM loader (``vllm.model_executor.model_loader``,
checked on vLLM 0.32-0.34): the inner format is named in
``--model-loader-extra-config '{"leap_inner_load_format": "gguf"}'`` (default
``auto``), and the rest of that extra config goes to the inner loader
unchanged. The loader is the one seam that runs in the worker after the model
exists and before ``torch.compile`` / graph capture, so the hook it installs
keeps firing in compiled runs.

The probe maps its buffer rows to requests with the step's batch layout
(:mod:`vllm_ext.leap.batch_layout`). On Model Runner V2 (vLLM 0.34's only
runner) the LeapConnector hands it that layout every step from
``start_load_kv``'s kwargs. On the V1 runner (the CPU build of vLLM 0.32/0.33)
it reads the runner's batch, bound here: :mod:`vllm_ext.patches.v1_runner_handle`
publishes the runner whose ``load_model`` is running, and its type is checked;
that patch is asked only where vLLM still ships the V1 runner. An engine whose
forward does not see the whole batch in row order (prefill context
parallelism, microbatching) is refused with one line before the weights load
(:mod:`vllm_ext.leap.runner_gate`).

Why a forward hook and ``start_load_kv``'s rows, and not one of Model Runner
V2's own seams (vLLM 0.34): its hidden-state capture path
(``spec_decode/extract_hidden_states.py``) is a speculative-decoding method
(it takes the drafter's place, stores the states in KV-cache blocks and hands
them to a connector that writes them out), so it would rule out real
speculative decoding and cost KV memory; a model-state class
(``model_states/``, ``get_model_state_cls()``) is chosen by the model and sees
the batch (``prepare_inputs``) but not a layer's output, so it would need both
a wrapped model class and a hook anyway; a worker extension adds methods that
the engine calls by RPC, with no per-step call. The hook is one copy in the
forward and survives compilation and CUDA graphs; the rows come from what the
KV-connector API already passes, on either runner.
"""

from __future__ import annotations

import dataclasses

from vllm.model_executor.model_loader import get_model_loader
from vllm.model_executor.model_loader.base_loader import BaseModelLoader
from vllm.platforms import current_platform

from vllm_ext.common import compat
from vllm_ext.common.compat import VllmCompatError
from vllm_ext.common.log import get_logger
from vllm_ext.leap import runner_gate
from vllm_ext.leap.batch_layout import V1RunnerLayout, V2StepLayout
from vllm_ext.leap.probe import ProbeState, decoder_layers
from vllm_ext.leap.settings import leap_config_from_vllm

logger = get_logger(__name__)

LOAD_FORMAT = "leap"
INNER_FORMAT_KEY = "leap_inner_load_format"
DEFAULT_INNER_FORMAT = "auto"

# the probe of this worker process, read by the worker-side LeapConnector
PROBE: ProbeState | None = None
# on Model Runner V2: where the LeapConnector hands over each step's rows
V2_STEPS: V2StepLayout | None = None
# the wrapped format's loader of the last LeapModelLoader (logs and tests read it)
LAST_INNER_LOADER = None


def inner_load_config(load_config):
    """The ``LoadConfig`` of the wrapped format: its name taken out of the extra config."""
    extra = load_config.model_loader_extra_config
    if not isinstance(extra, dict):
        raise ValueError(
            f"--model-loader-extra-config must be a JSON object for --load-format {LOAD_FORMAT}"
        )
    extra = dict(extra)
    inner = extra.pop(INNER_FORMAT_KEY, DEFAULT_INNER_FORMAT)
    if inner == LOAD_FORMAT:
        raise ValueError(f"{INNER_FORMAT_KEY} cannot be {LOAD_FORMAT!r} itself")
    return dataclasses.replace(load_config, load_format=inner, model_loader_extra_config=extra)


class LeapModelLoader(BaseModelLoader):
    """Loads with the wrapped format's loader, then installs the LEAP probe."""

    def __init__(self, load_config):
        global LAST_INNER_LOADER
        super().__init__(load_config)
        self.inner = LAST_INNER_LOADER = get_model_loader(inner_load_config(load_config))
        logger.info("LEAP loader wraps load format %r", self.inner.load_config.load_format)

    def download_model(self, model_config) -> None:
        self.inner.download_model(model_config)

    def load_weights(self, model, model_config) -> None:
        self.inner.load_weights(model, model_config)

    def get_external_weight_memory(self, vllm_config) -> int:
        return self.inner.get_external_weight_memory(vllm_config)

    def load_model(self, vllm_config, model_config, prefix: str = ""):
        global PROBE, V2_STEPS
        # before the weights load: an engine whose rows the probe cannot map is refused
        refused = runner_gate.engine_refusal(vllm_config.parallel_config)
        if refused is not None:
            raise VllmCompatError(refused)
        runner = loading_v1_runner()
        model = self.inner.load_model(
            vllm_config=vllm_config, model_config=model_config, prefix=prefix
        )
        PROBE, V2_STEPS = install_probe(model, vllm_config, model_config, runner)
        return model


def loading_v1_runner():
    """The V1 runner loading this model, else None (Model Runner V2; vLLM 0.34 has no V1)."""
    if not compat.has_v1_runner():
        return None
    from vllm_ext.patches import v1_runner_handle

    return v1_runner_handle.loading_runner()


def install_probe(model, vllm_config, model_config, runner=None):
    """The probe on ``model``'s layer, bound to its layout source; ``(probe, v2_steps)``.

    Args:
        runner: the V1 runner loading the model (its batch is the layout), or
            None on Model Runner V2 (the LeapConnector hands each step's rows
            to the returned :class:`V2StepLayout`; None on V1).
    """
    config = leap_config_from_vllm(vllm_config)
    probe = ProbeState(
        config.resolve_layer(len(decoder_layers(model))),
        config.pooling,
        model_config.get_hidden_size(),
        vllm_config.scheduler_config.max_num_batched_tokens,
        refine_every=config.decode_probe_every,
        deferred=config.probe_deferred(current_platform.is_cuda()),
    )
    probe.install(model)
    if runner is not None:
        probe.bind_layout(V1RunnerLayout(runner))
        return probe, None
    steps = V2StepLayout()
    probe.bind_layout(steps)
    logger.info("LEAP probe on Model Runner V2: rows mapped from start_load_kv's request_ids")
    return probe, steps
