"""``torch.ops.vllm_ext_etaps.sparse_gemm``, JIT-built from ``csrc/etaps_sparse_gemv/``.

The build (``torch.utils.cpp_extension.load``, g++ and ninja) is cached under
``~/.cache/vllm_ext/torch_ext/<source digest>``, so a clean clone builds it once.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

import torch

SOURCE = Path(__file__).resolve().parents[3] / "csrc" / "etaps_sparse_gemv" / "sparse_gemv.cpp"


@functools.cache
def load() -> None:
    """Build (once per source version) and load the extension; raises if it cannot build."""
    from torch.utils.cpp_extension import load as cpp_load

    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    build = cache / "vllm_ext" / "torch_ext" / f"etaps_sparse_gemv-{digest}"
    build.mkdir(parents=True, exist_ok=True)
    cpp_load(
        name=f"etaps_sparse_gemv_{digest}", sources=[str(SOURCE)], build_directory=str(build),
        extra_cflags=["-O3"], is_python_module=False, verbose=False,
    )  # fmt: skip
    _register_fake()


def _register_fake() -> None:
    @torch.library.register_fake("vllm_ext_etaps::sparse_gemm")
    def _fake(x, values, indices):
        return x.new_empty((x.shape[0], values.shape[0]))


def sparse_gemm(x: torch.Tensor, values: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    load()
    return torch.ops.vllm_ext_etaps.sparse_gemm(x, values, indices)
