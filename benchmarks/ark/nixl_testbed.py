"""NIXL pulls with ARK-planned vs random ports on the namespace leaf-spine (root, ``nixl``).

2 leaves x 4 hosts, 4 spines, leaf-spine links shaped to 40 Mbit/s and host
NICs to 80 Mbit/s (as ``benchmarks.ark.testbed``), ECMP on the 5-tuple. Four
pairs (leaf-0 host i serves, leaf-1 host i pulls) move one KV-sized DRAM buffer
each at the same moment with two NIXL agents per pair over UCX TCP (vLLM's pull
mode: the KV flows from the serving side's UCX listener to the pulling side's
port); the pulling process is preloaded with ARK's shim, which binds the port
the variant chose: ``random`` (a seeded random candidate per pair, plain ECMP)
or ``ark`` (planned from a path map probed on the serving leaf's FIB, one plan
over all pairs). FCT = from adding the remote agent (UCX connects then) to the
READ's completion. Same pairs and bytes for both variants in a round, order
shuffled per round. Timings on 2 shared cores are noisy.

Run: ``python -m benchmarks.ark.nixl_testbed`` (root, ``nixl`` importable; ~2 min).
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import statistics
import sys
import time

from vllm_ext.bench import (
    BenchResult,
    collect_fingerprint,
    headline_from_rounds,
    headline_text,
    write_result,
)

NAME = "ark_nixl_testbed"
TARGET = "lower mean FCT than random ports (no target of its own; ark_testbed has the headline)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mb", type=float, default=8.0, help="KV per pull (MB)")
    parser.add_argument("--out", default="benchmarks/out")
    args = parser.parse_args(argv)
    if importlib.util.find_spec("nixl") is None:
        print("skipped: nixl not installed (pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1)")
        return 0
    from benchmarks.ark.testbed import fingerprint_net
    from vllm_ext.ark.netns import LeafSpine
    from vllm_ext.ark.nixl_workload import VARIANTS, choose_ports, learn_paths, run_pulls
    from vllm_ext.ark.shim import build

    nbytes, shim, started = int(args.mb * 1e6), str(build()), time.time()
    results: dict[tuple[int, str], dict] = {}
    with LeafSpine(2, 4, 4, 40.0, host_rate_mbit=80.0) as fabric:
        net = fingerprint_net(fabric)
        pairs = [((0, i), (1, i)) for i in range(4)]
        paths = learn_paths(fabric, pairs)
        for seed in range(args.rounds):
            order = list(VARIANTS)
            random.Random(seed).shuffle(order)
            for variant in order:
                ports = choose_ports(fabric, pairs, variant, seed, paths)
                got = run_pulls(fabric, pairs, ports, nbytes, shim, seed)
                got["mean_fct_s"] = statistics.fmean(got["fcts_s"])
                results[(seed, variant)] = got
                spine_mb = [round(b / 1e6, 2) for b in got["spine_bytes_to_decode"]]
                print(f"round {seed} {variant}: mean FCT {got['mean_fct_s']:.3f} s, ports "
                      f"{ports}, spine MB {spine_mb}", flush=True)  # fmt: skip
    seeds = range(args.rounds)
    variants = {}
    for v in VARIANTS:
        values = [results[(s, v)]["mean_fct_s"] for s in seeds]
        failed = sum(not ok for s in seeds for ok in results[(s, v)]["ok"])
        variants[v] = {"mean_fct_s": statistics.median(values), "mean_fct_s_min": min(values),
                       "mean_fct_s_max": max(values), "failed": failed}  # fmt: skip
    ratios = [results[(s, "ark")]["mean_fct_s"] / results[(s, "random")]["mean_fct_s"]
              for s in seeds]  # fmt: skip
    result = BenchResult(
        name=NAME,
        description=__doc__.split("\n\n", 1)[1].rsplit("\n\nRun:", 1)[0]
        + "\n\nARK/random mean FCT per round: "
        + ", ".join(f"{r:.3f}" for r in ratios),
        variants=variants,
        headline=headline_from_rounds(
            f"mean_fct_s (median of {args.rounds} rounds)",
            [results[(s, "ark")]["mean_fct_s"] for s in seeds],
            [results[(s, "random")]["mean_fct_s"] for s in seeds],
            "random ports (ECMP)",
            False,
            TARGET,
        ),  # fmt: skip
        fingerprint={**collect_fingerprint(), "testbed": net},
        config={
            "rounds": args.rounds,
            "mb": args.mb,
            "wall_s": round(time.time() - started, 1),
            "per_round": {f"{s}/{v}": m for (s, v), m in results.items()},
        },  # fmt: skip
    )
    paths_out = write_result(result, args.out, plot=False)
    sys.stdout.write(headline_text(result.headline, "ark"))
    sys.stdout.write(f"wrote {paths_out['json']}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
