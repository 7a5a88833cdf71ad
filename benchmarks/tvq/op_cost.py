"""CPU-seconds per call of the TVQ lookup-GEMV vs a bf16 ``F.linear`` on SmolLM2's MLP shapes.

One token, one thread, the weights cache-resident (the same layer called repeatedly): this
isolates the op's compute cost from memory bandwidth, which is where a code-reading kernel
gains. Thread CPU time, so other load on the host does not count. Prints one JSON line per
shape and format.

    python -m benchmarks.tvq.op_cost --formats 2x64,4x256
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from vllm_ext.kernels.tvq_gemv import kernel_available, tvq_gemv

# (name, rows, in, shards): fused gate_up_proj and down_proj of SmolLM2-135M
SHAPES = (("gate_up_proj", 3072, 576, 2), ("down_proj", 576, 1536, 1))


def cpu_us(fn, calls: int) -> float:
    for _ in range(calls // 10 + 1):
        fn()
    start = time.thread_time()
    for _ in range(calls):
        fn()
    return (time.thread_time() - start) / calls * 1e6


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--formats", default="2x64,4x256", help="vec_dim x num_codewords, comma list")
    p.add_argument("--calls", type=int, default=300)
    a = p.parse_args(argv)
    if not kernel_available():
        raise SystemExit("the compiled TVQ kernel is not available (no C++ compiler?)")
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    for name, rows, inp, shards in SHAPES:
        w = torch.randn(rows, inp, generator=gen).bfloat16()
        x = torch.randn(1, inp, generator=gen).bfloat16()
        dense = cpu_us(lambda w=w, x=x: F.linear(x, w), a.calls)
        for fmt in a.formats.split(","):
            dim, k = (int(v) for v in fmt.split("x"))
            codes = torch.randint(0, k, (rows, inp // dim), generator=gen)
            codes = codes.to(torch.uint8 if k <= 256 else torch.int32)
            cb, scale = torch.randn(shards, k, dim, generator=gen), torch.rand(rows, 1)
            bounds = torch.linspace(0, rows, shards + 1).long()
            ours = cpu_us(lambda c=codes, cb=cb, s=scale, b=bounds, x=x: tvq_gemv(x, c, cb, s, b),
                          a.calls)  # fmt: skip
            print(json.dumps({"shape": name, "rows": rows, "in": inp, "format": fmt,
                              "tvq_us": round(ours, 1), "bf16_us": round(dense, 1),
                              "bf16_over_tvq": round(dense / ours, 3)}))  # fmt: skip


if __name__ == "__main__":
    main()
