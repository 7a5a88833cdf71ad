"""Packed-attention kernel cases, shared by the interpreter (CPU) and GPU tests.

``python -m tests.kernel_cases DEVICE`` checks every implementation against the
fp32 reference and prints the largest difference per case; it exits non-zero
on the first mismatch. Run it with ``TRITON_INTERPRET=1`` (set before Triton is
first imported) to execute the Triton kernel on CPU tensors.
"""

from __future__ import annotations

import os
import sys

import torch

from vllm_ext.flide.packing import key_start, pack_segments
from vllm_ext.kernels.packed_attention.blocks import packed_attention_blocks
from vllm_ext.kernels.packed_attention.ref import packed_attention_ref
from vllm_ext.kernels.packed_attention.sdpa import packed_attention_sdpa

# (segment lengths, parents): contexts with questions, a label continuation, lone roots,
# segments shorter and longer than a tile, one long shared context
LAYOUTS = {
    "two_groups": ([40, 7, 13, 20, 5, 3], [-1, 0, 0, -1, 3, 2]),
    "lone_roots": ([1, 17, 33], [-1, -1, -1]),
    "wide": ([96] + [9] * 24, [-1] + [0] * 24),
}
# (query heads, kv heads, head dim): multi-head, grouped-query, SmolLM2's 64, 128
HEADS = [(4, 4, 16), (4, 2, 32), (9, 3, 64), (2, 1, 128)]
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def cases(device: str, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(0)
    for name, (lengths, parents) in LAYOUTS.items():
        segments = [list(range(n)) for n in lengths]
        layout = pack_segments(segments, parents)
        for hq, hk, d in HEADS:
            shapes = [(layout.num_tokens, h, d) for h in (hq, hk, hk)]
            q, k, v = (torch.randn(*s, generator=gen).to(device, dtype) for s in shapes)
            yield f"{name}/h{hq}k{hk}d{d}", layout, q, k, v


def implementations(device: str):
    """name -> fn(q, k, v, layout, scale) for every path that runs on ``device``."""
    impls = {
        "sdpa": lambda q, k, v, lay, s: packed_attention_sdpa(
            q, k, v, lay.segment_of.to(q.device), lay.visible.to(q.device), s,
            key_start(lay).to(q.device), chunk=32),
        "blocks": lambda q, k, v, lay, s: packed_attention_blocks(
            q, k, v, lay.starts, lay.ends, lay.parent, s),
    }  # fmt: skip
    from vllm_ext.kernels.packed_attention import triton as tri

    # on CPU tensors the kernel runs only in Triton's interpreter
    if tri.TRITON_AVAILABLE and (device != "cpu" or os.environ.get("TRITON_INTERPRET") == "1"):
        impls["triton"] = lambda q, k, v, lay, s: tri.packed_attention_triton(
            q, k, v, lay.segment_of.to(q.device), lay.visible.to(q.device), s,
            key_start(lay).to(q.device))  # fmt: skip
    return impls


def check(device: str, dtypes=(torch.float32,)) -> dict[str, float]:
    """Largest |implementation - reference| per case; raises on a mismatch."""
    worst: dict[str, float] = {}
    for dtype in dtypes:
        for case, layout, q, k, v in cases(device, dtype):
            scale = q.shape[-1] ** -0.5
            ref = packed_attention_ref(q.float().cpu(), k.float().cpu(), v.float().cpu(),
                                       layout.segment_of, layout.visible, scale)  # fmt: skip
            for impl, fn in implementations(device).items():
                out = fn(q, k, v, layout, scale).float().cpu()
                err = (out - ref).abs().max().item()
                key = f"{impl}/{str(dtype).removeprefix('torch.')}"
                worst[key] = max(worst.get(key, 0.0), err)
                if not err <= TOLERANCE[dtype]:
                    raise AssertionError(f"{impl} {case} {dtype}: max error {err:.3g}")
    return worst


if __name__ == "__main__":
    device = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    dtypes = (torch.float32,) if device == "cpu" else (torch.float32, torch.bfloat16)
    for key, err in check(device, dtypes).items():
        sys.stdout.write(f"{key} max_abs_err={err:.3g}\n")
