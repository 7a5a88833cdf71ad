"""``vllm-ext memx plan`` (training parallel plans) and ``vllm-ext memx serve`` (vLLM per group).

``plan --cluster c.yaml --model m.yaml --global-batch 512 --seq 4096``
prints the top plans of MemX and, side by side, the picks of the Metis-style
(time only), Sailor-style (time, Sailor's memory accounting) and balance
rankings on the same space, with time, peak memory and OOM flags;
``--json`` writes them, ``--plot`` draws per-device memory of the top picks.
"""

from __future__ import annotations

import argparse
import json
import sys

from vllm_ext.memx.search import RANKINGS, Objective, Space, search
from vllm_ext.memx.serving import plan_serving
from vllm_ext.memx.spec import SpecError, load_cluster, load_model


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-ext memx", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    plan = sub.add_parser("plan", help="search training parallel plans")
    serve = sub.add_parser("serve", help="vllm serve arguments per device group")
    for p in (plan, serve):
        p.add_argument("--cluster", required=True, help="cluster YAML (device groups)")
        p.add_argument("--model", required=True, help="model YAML")
        p.add_argument("--json", help="write the result here")
    plan.add_argument("--global-batch", type=int, required=True, help="sequences per iteration")
    plan.add_argument("--seq", type=int, required=True, help="tokens per sequence")
    plan.add_argument(
        "--micro-batch",
        type=_ints,
        default=(1, 2, 4, 8),
        help="micro-batch sizes to try (default 1,2,4,8)",
    )
    plan.add_argument(
        "--objective",
        default="time+0.5*peak+2*var",
        help="weights of time/T_ideal, max memory utilisation and its variance",
    )
    plan.add_argument("--top", type=int, default=5)
    plan.add_argument("--plot", help="PNG of per-device memory of each ranking's pick")
    plan.add_argument("--no-progress", action="store_true")
    serve.add_argument("--hf-model", default="MODEL", help="model name for the vllm serve lines")
    serve.add_argument("--context", type=int, required=True, help="tokens per request")
    serve.add_argument("--concurrency", type=int, required=True, help="requests in flight")
    serve.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    return parser


def _row(rank: int, p) -> str:
    layout = " | ".join(
        f"{g['group']}: {g['stages']}st dp{g['dp']} tp{g['tp']}{' rc' if g['recompute'] else ''}"
        f" L{g['layers']} {g['peak_gib']:.1f}G"
        for g in p.groups
    )
    oom = "OOM" if p.oom else "ok"
    return (
        f"{rank:>3} {p.time_s:9.3f} {p.max_util:6.1%} {p.var_util:8.4f} {p.score:7.3f} "
        f"{oom:>4} mb{p.micro_batch} {layout}"
    )


def _table(result, top: int) -> str:
    head = f"{'#':>3} {'time s':>9} {'peak':>6} {'var':>8} {'score':>7} {'mem':>4} plan"
    lines = ["MemX top plans:", head]
    lines += [_row(i + 1, p) for i, p in enumerate(result.top["memx"][:top])]
    lines += ["", "Each ranking's pick on the same space:", head.replace("#  ", "who")]
    for name in RANKINGS:
        picks = result.top[name]
        lines.append(f"{name:>7}: " + (_row(1, picks[0])[4:] if picks else "no plan fits"))
    lines.append(
        f"\n{result.evaluated:,} configurations in {result.seconds:.2f} s "
        f"({result.configs_per_s:,.0f}/s), {result.feasible:,} fit in memory"
    )
    return "\n".join(lines) + "\n"


def _plot(result, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    names = [r for r in RANKINGS if result.top[r]]
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        groups = result.top[name][0].groups
        xs = [j + i * width for j in range(len(groups))]
        ax.bar(xs, [g["util"] * 100 for g in groups], width, label=name)
    ax.axhline(100, color="red", lw=1)
    ax.set_xticks(
        [j + 0.4 - width / 2 for j in range(len(groups))],
        [g["group"] for g in sorted(groups, key=lambda g: g["group"])],
    )
    ax.set_ylabel("peak memory, % of device")
    ax.set_title("per-device-group peak memory of each ranking's pick")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _cmd_plan(args) -> int:
    space = Space(
        load_cluster(args.cluster),
        load_model(args.model),
        args.seq,
        args.global_batch,
        args.micro_batch,
    )
    objective = Objective.parse(args.objective)
    if args.top <= 0:
        raise SpecError(f"--top must be > 0, got {args.top}")
    result = search(space, objective, args.top, progress=not args.no_progress)
    if result.binding:
        sys.stderr.write(
            f"vllm-ext memx: error: no plan fits; binding constraint: {result.binding}\n"
        )
        return 1
    sys.stdout.write(_table(result, args.top))
    if args.json:
        data = {
            "evaluated": result.evaluated,
            "feasible": result.feasible,
            "seconds": result.seconds,
            "configs_per_s": result.configs_per_s,
            "objective": objective.__dict__,
            "top": {r: [p.to_dict() for p in v] for r, v in result.top.items()},
        }
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)
    if args.plot:
        _plot(result, args.plot)
    return 0


def _cmd_serve(args) -> int:
    cluster, model = load_cluster(args.cluster), load_model(args.model)
    plans = plan_serving(
        cluster, model, args.context, args.concurrency, args.gpu_memory_utilization
    )
    for p in plans:
        line = " ".join(p.args(args.hf_model, args.gpu_memory_utilization))
        sys.stdout.write(
            f"# {p.group}: {p.replicas} replica(s), {p.weights_gib:.1f} GiB "
            f"weights + {p.kv_gib:.1f} GiB KV per GPU ({p.util:.0%})\n{line}\n"
        )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(
                [
                    p.__dict__ | {"args": p.args(args.hf_model, args.gpu_memory_utilization)}
                    for p in plans
                ],
                f,
                indent=1,
            )
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _cmd_plan(args) if args.command == "plan" else _cmd_serve(args)
    except SpecError as exc:
        sys.stderr.write(f"vllm-ext memx: error: {exc}\n")
        return 2
