"""Build (on first use) and call the compiled TVQ lookup-GEMV (``csrc/tvq_gemv/``).

The op is compiled with ``torch.utils.cpp_extension.load`` into the cache,
keyed by the source's hash, and registered as ``torch.ops.vllm_ext_tvq.tvq_gemv``.
With no compiler (or no source checkout) :func:`load` returns False and logs
one warning; callers then use the reference.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

import torch

from vllm_ext.common.log import get_logger

logger = get_logger(__name__)

SOURCE = Path(__file__).resolve().parents[3] / "csrc" / "tvq_gemv" / "tvq_gemv.cpp"
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "vllm_ext" / "tvq"


@functools.cache
def load() -> bool:
    """True when the compiled op is registered (built now or found in the cache)."""
    if hasattr(torch.ops.vllm_ext_tvq, "tvq_gemv"):
        return True
    try:
        from torch.utils.cpp_extension import load as cpp_load

        if not SOURCE.is_file():
            raise FileNotFoundError(f"{SOURCE} (the kernel builds from a source checkout)")
        digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
        build_dir = CACHE / f"tvq_gemv-{digest}"
        build_dir.mkdir(parents=True, exist_ok=True)
        cpp_load(
            name="vllm_ext_tvq_gemv",
            sources=[str(SOURCE)],
            build_directory=str(build_dir),
            extra_cflags=["-O3", "-march=native"],
            is_python_module=False,
        )
    except Exception as exc:  # any build failure falls back to the reference
        logger.warning("TVQ kernel unavailable, using the torch reference: %s", exc)
        return False
    _register_fake()
    return True


def _register_fake() -> None:
    @torch.library.register_fake("vllm_ext_tvq::tvq_gemv")
    def _(x, codes, codebook, scale, shard_rows):
        torch._check(x.shape[1] == codes.shape[1] * codebook.shape[2])
        return x.new_empty((x.shape[0], codes.shape[0]))


def tvq_gemv(x, codes, codebook, scale, shard_rows) -> torch.Tensor:
    """The compiled op; see ``ref.tvq_matmul_ref`` for shapes and math."""
    return torch.ops.vllm_ext_tvq.tvq_gemv(x, codes, codebook, scale, shard_rows)
