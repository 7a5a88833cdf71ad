"""GPTQ (llmcompressor) of SmolLM2's MLP linears, scored on the same held-out tokens as ``quality``.

llmcompressor is not a dependency of vllm_ext (it pins its own transformers):
run this from a throwaway venv that sees the project's packages, e.g.

    python -m venv /tmp/lc
    echo /work/main/.venv/lib/python3.11/site-packages > /tmp/lc/lib/python3.11/site-packages/x.pth
    /tmp/lc/bin/pip install llmcompressor
    PYTHONPATH=$PWD /tmp/lc/bin/python -m benchmarks.tvq.gptq --bits 3

Scheme: integer, asymmetric, one scale and zero per output channel (the
bits of ``rtn<b>_row`` in ``quality``), MLP linears only, the same calibration
chunks as the VQ init (ShareGPT 0-3k, ``--calib-chunks`` x 256 tokens). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default="smollm2")
    p.add_argument("--bits", type=int, default=3)
    p.add_argument("--calib-chunks", type=int, default=4)
    p.add_argument("--eval-chunks", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args(argv)
    import torch
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier

    from vllm_ext.tvq import data, train
    from vllm_ext.tvq.cli import _base, _teacher

    torch.set_num_threads(a.threads)
    model, tok = _teacher(_base(a.base))
    calib = data.token_chunks(tok, a.calib_chunks, 256, held_out=False)
    held_out = data.token_chunks(tok, a.eval_chunks, 512, held_out=True)
    rows = [r.tolist() for r in calib]
    ds = Dataset.from_dict({"input_ids": rows, "attention_mask": [[1] * len(r) for r in rows]})
    weights = QuantizationArgs(num_bits=a.bits, type="int", symmetric=False, strategy="channel")
    scheme = QuantizationScheme(targets=[r"re:.*mlp\.(gate|up|down)_proj$"], weights=weights)
    start = time.perf_counter()
    oneshot(model=model, dataset=ds, recipe=GPTQModifier(config_groups={"mlp": scheme}),
            max_seq_length=256, num_calibration_samples=len(rows), pipeline="basic")  # fmt: skip
    seconds = time.perf_counter() - start
    ppl = train.perplexity(model, held_out)
    print(json.dumps({"variant": f"gptq{a.bits}_row", "ppl": ppl, "gptq_s": seconds}))


if __name__ == "__main__":
    main()
