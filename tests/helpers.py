"""Shared test helpers: in-process engines and engine settings sized for a 2-core CPU."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from vllm_ext.assets import model_path

# small, explicit KV size: on CPU gpu_memory_utilization reserves a share of all RAM
ENGINE_DEFAULTS = dict(
    enforce_eager=True, kv_cache_memory_bytes=256 << 20, max_model_len=4096, seed=0
)


@contextmanager
def engine(model: str | Path, **kwargs) -> Iterator:
    """An in-process ``vllm.LLM`` over model asset ``model`` (or a model folder); freed on exit.

    Callers must drop their reference (``del llm``) before starting another engine.
    """
    from vllm import LLM

    # an engine finalized while another runs would tear down the shared
    # distributed state under it: finish off dropped engines first
    gc.collect()
    folder = model if isinstance(model, Path) else model_path(model)
    llm = LLM(model=str(folder), **{**ENGINE_DEFAULTS, **kwargs})
    try:
        yield llm
    finally:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        del llm
        gc.collect()
        # parallel groups outlive the engine in-process; a later engine (e.g. a MoE
        # model that needs the expert-parallel group) must start from a clean slate
        cleanup_dist_env_and_memory()
