"""Random cases for the TVQ Triton lookup-GEMV against the fp32 reference.

``python -m tests.tvq_kernel_cases DEVICE`` prints one ``triton/<dtype> <worst error>`` line per
dtype and exits non-zero on the first mismatch. On CPU run it with ``TRITON_INTERPRET=1`` (set
before Triton is first imported).
"""

from __future__ import annotations

import sys

import torch

from vllm_ext.kernels.tvq_gemv.ref import tvq_matmul_ref
from vllm_ext.kernels.tvq_gemv.triton import tvq_gemv_triton

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def random_case(gen: torch.Generator, device: str, dtype: torch.dtype):
    """Random shards, sizes off the tile multiples, codebook sizes both sides of 256."""
    dim = int(torch.randint(1, 9, (1,), generator=gen))
    k = int(torch.tensor([4, 16, 256, 300])[torch.randint(0, 4, (1,), generator=gen)])
    groups = int(torch.randint(1, 80, (1,), generator=gen))
    sizes = torch.randint(1, 70, (int(torch.randint(1, 4, (1,), generator=gen)),), generator=gen)
    rows = int(sizes.sum())
    bounds = torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)])
    code_dtype = torch.uint8 if k <= 256 else torch.int32
    codes = torch.randint(0, k, (rows, groups), generator=gen).to(code_dtype)
    cb = torch.randn(len(sizes), k, dim, generator=gen)
    scale = torch.rand(rows, 1, generator=gen) + 0.5
    x = torch.randn(int(torch.randint(1, 9, (1,), generator=gen)), groups * dim, generator=gen)
    x = x.to(dtype)
    return [t.to(device) for t in (x, codes, cb, scale, bounds)]


def check(device: str, dtypes=(torch.float32,), cases: int = 12) -> dict[str, float]:
    gen = torch.Generator().manual_seed(0)
    worst: dict[str, float] = {}
    for dtype in dtypes:
        key = f"triton/{str(dtype).removeprefix('torch.')}"
        for _ in range(cases):
            x, codes, cb, scale, bounds = random_case(gen, device, dtype)
            want = tvq_matmul_ref(x.cpu().float(), codes.cpu(), cb.cpu(), scale.cpu(),
                                  bounds.cpu())  # fmt: skip
            got = tvq_gemv_triton(x, codes, cb, scale, bounds).float().cpu()
            err = float(((got - want).abs() / (want.abs() + 1)).max())
            if err > TOLERANCE[dtype]:
                shapes = f"x {tuple(x.shape)} codes {tuple(codes.shape)} codebook {tuple(cb.shape)}"
                raise AssertionError(f"{key}: error {err} on {shapes}")
            worst[key] = max(worst.get(key, 0.0), err)
    return worst


if __name__ == "__main__":
    dev = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    types = (torch.float32,) if dev == "cpu" else (torch.float32, torch.bfloat16, torch.float16)
    for name, error in check(dev, types).items():
        print(name, f"{error:.3g}")
