"""``--load-format leap``: vLLM's default loader plus the LEAP probe, installed at load time.

Extends ``vllm.model_executor.model_loader.DefaultModelLoader`` (vLLM 0.32.0).
The loader is the one seam that runs in the worker after the model exists and
before ``torch.compile`` / graph capture, so the hook it installs keeps
firing in compiled runs. Weights load exactly as with ``--load-format auto``.
"""

from __future__ import annotations

import dataclasses

from vllm.model_executor.model_loader import DefaultModelLoader
from vllm.platforms import current_platform

from vllm_ext.common.log import get_logger
from vllm_ext.leap.probe import ProbeState, decoder_layers, find_calling_runner
from vllm_ext.leap.settings import leap_config_from_vllm

logger = get_logger(__name__)

LOAD_FORMAT = "leap"

# the probe of this worker process, read by the worker-side LeapConnector
PROBE: ProbeState | None = None


class LeapModelLoader(DefaultModelLoader):
    """DefaultModelLoader that installs the LEAP probe on the loaded model."""

    def __init__(self, load_config):
        # DefaultModelLoader validates load_format against the formats it knows
        super().__init__(dataclasses.replace(load_config, load_format="auto"))

    def load_model(self, vllm_config, model_config, prefix: str = ""):
        global PROBE
        runner = find_calling_runner()
        model = super().load_model(
            vllm_config=vllm_config, model_config=model_config, prefix=prefix
        )
        config = leap_config_from_vllm(vllm_config)
        layer = config.resolve_layer(len(decoder_layers(model)))
        probe = ProbeState(
            layer,
            config.pooling,
            model_config.get_hidden_size(),
            vllm_config.scheduler_config.max_num_batched_tokens,
            refine_every=config.decode_probe_every,
            deferred=config.probe_deferred(current_platform.is_cuda()),
        )
        probe.install(model, runner)
        PROBE = probe
        return model
