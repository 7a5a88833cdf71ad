"""ARK vs random ports, k-subflow splitting and the offline assignment on a namespace leaf-spine.

Real TCP flows through Linux network namespaces (needs root): 2 leaves x 4
hosts, 4 spines, leaf-spine links shaped by ``tc tbf`` to 40 Mbit/s and host
NICs to 80 Mbit/s (2:1 oversubscribed leaf uplinks, so a flow's rate is set by
the spine link it hashes to, not by a receiver NIC; ``--host-rate-mbit 40``
gives the equal-rate fabric), ECMP at the leaves with ``fib_multipath_hash_policy=3`` and
``fib_multipath_hash_fields=0x37`` (5-tuple). Leaf 0's hosts are prefill
senders, leaf 1's decode receivers. Per round, one P/D trace (Poisson
arrivals, log-normal prompts of median 300 tokens, KV of SmolLM2-135M's shape:
30 layers x 3 KV heads x head dim 64 x bf16 = 22.5 KiB per token, prefill at
170 tokens/s per instance, i.e. KV produced at ~0.8x a spine link's rate while busy,
prefill utilization 0.6); queue and prefill times are the trace's, only the
transfers run. ARK's senders announce over UDP across the fabric and plan
with a path map learned by probing the source leaf's FIB. Every variant runs
the same flows with the same seed in each round (variant order shuffled per
round); per-spine byte counters on the spines are the ground truth of where
the bytes went. FCT = from the transfer's scheduled start to the receiver's
ack (connection setup included). Timings on 2 shared cores are noisy.

Run: ``make ark-testbed`` or ``python -m benchmarks.ark.testbed`` (root, ~6 min).
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
from pathlib import Path

from vllm_ext.bench import (
    BenchResult,
    collect_fingerprint,
    headline_from_rounds,
    headline_text,
    write_result,
)

NAME = "ark_testbed"
TARGET = "ratio <= 0.73 (random/ARK >= 1.37: >= 27 % lower mean FCT; paper -27.3 %)"
SHOWN = ("mean_fct_s", "p50_fct_s", "p99_fct_s", "mean_ttft_s", "failed")


def make_trace(seed: int, n_requests: int):
    from vllm_ext.ark.traces import KvGeometry, PrefillModel, PromptLengths, arrival_rate, pd_trace

    geometry, model = KvGeometry(30, 3, 64, 2), PrefillModel(0.01, 170.0, 0.0)
    lengths = PromptLengths(300, 0.6, 64, 1024)
    rate = arrival_rate(0.6, 4, lengths, model)
    return pd_trace(n_requests, rate, 4, 4, seed, geometry, model, lengths)


def fingerprint_net(fabric) -> dict:
    from vllm_ext.ark.netns import run_in

    leaf = fabric.leaf(0)
    out = run_in(leaf, "sysctl", "net.ipv4.fib_multipath_hash_policy",
                 "net.ipv4.fib_multipath_hash_fields")  # fmt: skip
    return {"leaf_sysctls": out.strip().splitlines(), "n_spines": fabric.n_spines,
            "hosts_per_leaf": fabric.hosts_per_leaf, "rate_mbit": fabric.rate_mbit,
            "host_rate_mbit": fabric.host_rate_mbit,
            "qdisc": "tbf"}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    from vllm_ext.ark.netns import LeafSpine
    from vllm_ext.ark.testbed import VARIANTS, Testbed

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--rate-mbit", type=float, default=40.0, help="leaf-spine links")
    parser.add_argument("--host-rate-mbit", type=float, default=80.0, help="host NICs")
    parser.add_argument("--out", default="benchmarks/out")
    args = parser.parse_args(argv)
    results: dict[tuple[int, str], dict] = {}
    started = time.time()
    with LeafSpine(2, 4, 4, args.rate_mbit, host_rate_mbit=args.host_rate_mbit) as fabric:
        net = fingerprint_net(fabric)
        bed = Testbed(fabric, args.rate_mbit * 1e6 / 8)
        try:
            for seed in range(args.rounds):
                trace = make_trace(seed, args.requests)
                order = list(VARIANTS)
                random.Random(seed).shuffle(order)
                for variant in order:
                    results[(seed, variant)] = bed.run(trace, variant, seed)
                    m = results[(seed, variant)]
                    print(f"round {seed} {variant}: mean FCT {m['mean_fct_s']:.3f} s, "
                          f"spines {m['spine_mb_to_decode']}", flush=True)  # fmt: skip
        finally:
            bed.close()
    seeds = range(args.rounds)
    variants = {}
    for v in VARIANTS:
        row = {}
        for key in SHOWN:
            values = [results[(s, v)][key] for s in seeds]
            row[key] = statistics.median(values)
            row[f"{key}_min"], row[f"{key}_max"] = min(values), max(values)
        variants[v] = row
    per_round = {v: [results[(s, "ark")]["mean_fct_s"] / results[(s, v)]["mean_fct_s"]
                     for s in seeds] for v in VARIANTS if v != "ark"}  # fmt: skip
    result = BenchResult(
        name=NAME,
        description=__doc__.split("\n\n", 1)[1].rsplit("\n\nRun:", 1)[0]
        + "\n\nARK/baseline mean FCT per round: "
        + "; ".join(f"{v}: " + ", ".join(f"{r:.3f}" for r in rs) for v, rs in per_round.items()),
        variants=variants,
        headline=headline_from_rounds(
            f"mean_fct_s (median of {args.rounds} rounds)",
            [results[(s, "ark")]["mean_fct_s"] for s in seeds],
            [results[(s, "random")]["mean_fct_s"] for s in seeds],
            "random source ports (ECMP)", False, TARGET,
        ),  # fmt: skip
        fingerprint={**collect_fingerprint(), "testbed": net},
        config={"rounds": args.rounds, "requests": args.requests, "rate_mbit": args.rate_mbit,
                "host_rate_mbit": args.host_rate_mbit,
                "per_round": {f"{s}/{v}": m for (s, v), m in results.items()},
                "ratios_ark_over": per_round, "wall_s": round(time.time() - started, 1)},
    )  # fmt: skip
    paths = write_result(result, args.out, plot=False)
    plot(results, seeds, Path(args.out) / f"{NAME}.png")
    sys.stdout.write(headline_text(result.headline, "ark"))
    sys.stdout.write(f"wrote {paths['json']}\n")
    return 0


def plot(results, seeds, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from vllm_ext.ark.testbed import VARIANTS

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    for v in VARIANTS:
        axes[0, 0].plot([results[(s, v)]["mean_fct_s"] for s in seeds], marker="o", label=v)
        fcts = sorted(x for s in seeds for x in results[(s, v)]["fcts_s"] if math.isfinite(x))
        axes[0, 1].plot(fcts, [(i + 1) / len(fcts) for i in range(len(fcts))], label=v)
        spines = results[(seeds[0], v)]["spine_mb_to_decode"]
        axes[1, 0].bar([i + 0.2 * VARIANTS.index(v) for i in range(len(spines))], spines, 0.2,
                       label=v)  # fmt: skip
    for v, ls in (("random", "--"), ("ark", "-")):
        samples = results[(seeds[0], v)]["spine_mb_over_time"]
        for spine in range(len(samples[0][1]) if samples else 0):
            axes[1, 1].plot([t for t, _ in samples], [mb[spine] for _, mb in samples], ls=ls,
                            label=f"{v} spine {spine}")  # fmt: skip
    axes[0, 0].set(xlabel="round", ylabel="mean FCT (s)", title="mean FCT per round")
    axes[0, 1].set(xlabel="FCT (s)", ylabel="fraction of transfers", title="FCT CDF, all rounds")
    axes[1, 0].set(xlabel="spine", ylabel="MB to the decode leaf", title="per-spine bytes, round 0")
    axes[1, 1].set(xlabel="time (s)", ylabel="MB to the decode leaf (cumulative)",
                   title="per-spine bytes over time, round 0")  # fmt: skip
    for ax in axes.flat:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
