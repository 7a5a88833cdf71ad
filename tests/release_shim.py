"""What a process running a newer vLLM release's Python code on this CPU needs.

Imported by the 0.34 tier's conftest (``tests/vllm034``) and by the pytest
plugin that runs vLLM's own suites (``tests/vllm_suites/swap_plugin.py``).
Two accommodations, both about this machine, none about the code under test:

- **triton-cpu**: 0.34's ``CpuPlatform.check_and_update_config`` refuses x86
  without it (not on the package registry). The check is the only thing that
  reads ``HAS_TRITON`` there; it is made to pass for the duration of that call,
  so configs build as they would on a host that has triton-cpu. Nothing that
  runs a kernel is reached: these tests build configs, schedulers, managers
  and connectors, never an engine.
- **Model ids offline**: vLLM's tests name hub models (``facebook/opt-125m``,
  ``Qwen/Qwen3-0.6B``, ``Qwen/Qwen3-Next-80B-A3B-Instruct``). An offline
  Hugging Face cache maps each to a local asset of the same kind (dense
  decoder: SmolLM2-135M; Qwen3-Next hybrid: the tiny random hybrid), so a
  test's ``ModelConfig`` resolves with ``HF_HUB_OFFLINE=1``. Ids with no local
  stand-in (multimodal llava, ...) stay unresolvable and those tests fail,
  listed as such by the suite runner.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from vllm_ext.assets.models import model_path

# hub id -> our asset of the same architecture family
HUB_STANDINS = {
    "facebook/opt-125m": "smollm2",
    "Qwen/Qwen3-0.6B": "smollm2",
    "meta-llama/Llama-3.2-1B-Instruct": "smollm2",
    "Qwen/Qwen3-Next-80B-A3B-Instruct": "tiny-hybrid",
}
_REVISION = "0000000000000000000000000000000000000000"


def offline_hub(root: Path) -> Path:
    """A Hugging Face hub cache under ``root`` whose snapshots are our assets (idempotent)."""
    for repo_id, asset in HUB_STANDINS.items():
        repo = root / ("models--" + repo_id.replace("/", "--"))
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / "main").write_text(_REVISION)
        snapshot = repo / "snapshots" / _REVISION
        snapshot.mkdir(parents=True, exist_ok=True)
        for item in model_path(asset).iterdir():
            link = snapshot / item.name
            if not link.exists():
                link.symlink_to(item)
    return root


def use_offline_hub(root: Path) -> None:
    """Point this process's hub at :func:`offline_hub` (before vLLM resolves any model)."""
    os.environ["HF_HUB_CACHE"] = str(offline_hub(root))
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"


def allow_cpu_without_triton() -> None:
    """Let 0.34's CPU platform build configs on x86 without triton-cpu (see module doc)."""
    from vllm.platforms.cpu import CpuPlatform

    original = CpuPlatform.__dict__["check_and_update_config"].__func__
    if getattr(original, "_vllm_ext_shim", False):
        return

    @functools.wraps(original)
    def check_and_update_config(cls, vllm_config):
        import vllm.triton_utils as triton_utils

        saved = triton_utils.HAS_TRITON
        triton_utils.HAS_TRITON = True
        try:
            return original(cls, vllm_config)
        finally:
            triton_utils.HAS_TRITON = saved

    check_and_update_config._vllm_ext_shim = True
    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
