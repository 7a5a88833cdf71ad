"""vLLM 0.34 distributed state and model loading in the tier's process (no engine).

:func:`world_of_one` is vLLM's own ``dist_init`` test fixture (one rank,
gloo). :func:`create_model` runs the steps of 0.34's
``BaseModelLoader.load_model`` (create the model under its dtype and device,
load the checkpoint, ``process_weights_after_loading``) without its
``torch.accelerator.empty_cache()`` calls, which raise on a torch build with
no accelerator at all (this machine's); they only release cached device
memory.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def world_of_one() -> Iterator[None]:
    """vLLM's tensor/pipeline-parallel groups for a single rank, torn down on exit."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import (
        cleanup_dist_env_and_memory,
        init_distributed_environment,
        initialize_model_parallel,
    )

    fd, store = tempfile.mkstemp()
    os.close(fd)
    try:
        with set_current_vllm_config(VllmConfig()):
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method=f"file://{store}")  # fmt: skip
            initialize_model_parallel(1, 1)
        yield
    finally:
        cleanup_dist_env_and_memory()
        # gloo's FileStore removes its file when the group goes
        with contextlib.suppress(FileNotFoundError):
            os.unlink(store)


def create_model(vllm_config, load: bool = True) -> torch.nn.Module:
    """The model of ``vllm_config`` built by 0.34's loader on the CPU; with ``load``, its
    checkpoint loaded and post-processed (``load=False``: structure only, e.g. for models
    whose post-processing needs 0.34's compiled CPU ops)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.utils.torch_utils import set_default_torch_dtype

    model_config = vllm_config.model_config
    loader = get_model_loader(vllm_config.load_config)
    device = torch.device("cpu")
    with set_current_vllm_config(vllm_config):
        with set_default_torch_dtype(model_config.dtype), device:
            model = loader.create_model(vllm_config=vllm_config, model_config=model_config)
        if load:
            loader.load_weights(model, model_config)
            process_weights_after_loading(model, model_config, device)
    return model.eval()
