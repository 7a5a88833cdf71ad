"""Subprocess of the LEAP benchmark: probe vectors (prefill and decode) + greedy lengths.

``python -m benchmarks.leap.record MODEL PROMPTS.json OUT.npz MAX_TOKENS LEAP_JSON [DTYPE]``; runs
in its own process so the in-process engine's thread binding stays out of the benchmark.
"""

from __future__ import annotations

import json
import sys

import numpy as np

from vllm_ext.leap.calibrate import record


def main() -> int:
    model, prompts_path, out, max_tokens, leap = sys.argv[1:6]
    dtype = sys.argv[6] if len(sys.argv) > 6 else "auto"
    prompts = json.loads(open(prompts_path).read())
    rec = record(model, prompts, json.loads(leap), int(max_tokens), 0.0, dtype)
    if len(rec.y) != len(prompts):
        raise RuntimeError(f"{len(prompts) - len(rec.y)} prompts came back without a probe vector")
    np.savez(out, **rec.arrays())
    return 0


if __name__ == "__main__":
    sys.exit(main())
