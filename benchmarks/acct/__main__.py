"""``python -m benchmarks.acct speed|quality``: ACCT's two headlines.

Writes ``benchmarks/out/acct.json`` (speed) and ``benchmarks/out/acct_quality.json``
(quality) and ``benchmarks/out/acct_compressed.json`` (compressed mode), each with
.md and .png, through :func:`vllm_ext.bench.write_result`.
Single-thread CPU work: run it under ``nice`` on a shared machine.

    python -m benchmarks.acct speed --checkpoint CK --contexts 1024,2048,4096,8192
    python -m benchmarks.acct quality --checkpoint kl=CK_KL --checkpoint ridge=CK_RIDGE
    python -m benchmarks.acct compressed --context 2048 --fractions 0.1,0.25,0.5
"""

from __future__ import annotations

import argparse
import sys

from vllm_ext.acct.cli import resolve_model
from vllm_ext.bench import headline_text, write_result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.acct", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    speed = sub.add_parser("speed")
    speed.add_argument("--checkpoint", help="converter checkpoint (default: untrained, same cost)")
    speed.add_argument("--contexts", default="1024,2048,4096,8192")
    speed.add_argument("--rounds", type=int, default=3)
    speed.add_argument("--source-layers", type=int, default=4)
    speed.add_argument("--sink-tokens", type=int, default=4)
    quality = sub.add_parser("quality")
    quality.add_argument(
        "--checkpoint",
        action="append",
        required=True,
        help="NAME=FOLDER or NAME=FOLDER:TAIL (exact tail tokens)",
    )
    quality.add_argument("--windows", type=int, default=8)
    quality.add_argument("--context", type=int, default=1536)
    quality.add_argument("--continuation", type=int, default=256)
    quality.add_argument("--needles", type=int, default=0, help="needle/QA exact-match items")
    quality.add_argument(
        "--write-gate",
        action="append",
        default=[],
        metavar="NAME",
        help="store the measured offline gate in checkpoint NAME",
    )
    quality.add_argument("--max-delta-nll", type=float, default=0.05)
    quality.add_argument("--min-top1", type=float, default=0.97)
    comp = sub.add_parser("compressed", help="per-head token dropping: NLL vs KV kept")
    comp.add_argument("--context", type=int, default=2048)
    comp.add_argument("--continuation", type=int, default=64)
    comp.add_argument("--train", type=int, default=6, help="training windows for the scorer")
    comp.add_argument("--windows", type=int, default=4, help="held-out evaluation windows")
    comp.add_argument("--fractions", default="0.1,0.25,0.5")
    comp.add_argument("--source-layers", type=int, default=4)
    comp.add_argument("--sink-tokens", type=int, default=4)
    for p in (speed, quality, comp):
        p.add_argument("--model", default="smollm2")
        p.add_argument("--out", default="benchmarks/out")
    args = parser.parse_args(argv)
    model_dir = resolve_model(args.model)
    progress = lambda text: print(text, file=sys.stderr, flush=True)  # noqa: E731
    if args.command == "speed":
        from benchmarks.acct.speed import run_incremental

        contexts = [int(c) for c in args.contexts.split(",")]
        # written after every context: a run cut short still leaves its evidence
        for result in run_incremental(model_dir, args.checkpoint, contexts, args.rounds,
                                      args.source_layers, args.sink_tokens, progress):  # fmt: skip
            paths = write_result(result, args.out)
    elif args.command == "compressed":
        from benchmarks.acct.compressed import run

        fractions = [float(f) for f in args.fractions.split(",")]
        result = run(model_dir, args.context, args.continuation, args.train, args.windows,
                     fractions, args.source_layers, args.sink_tokens, progress)  # fmt: skip
    else:
        from benchmarks.acct.quality import run

        checkpoints = dict(item.split("=", 1) for item in args.checkpoint)
        result = run(model_dir, checkpoints, args.windows, args.context, args.continuation,
                     progress, args.needles)  # fmt: skip
        from benchmarks.acct.quality import gate_of
        from vllm_ext.acct.checkpoint import write_gate

        for name in args.write_gate:
            gate = gate_of(result, name, args.max_delta_nll, args.min_top1)
            write_gate(
                checkpoints[name].partition(":")[0], gate, result.config["tail_tokens"][name]
            )
            progress(f"gate of {name}: {'passed' if gate['passed'] else 'FAILED'} {gate}")
    if args.command != "speed":
        paths = write_result(result, args.out)
    print(headline_text(result.headline))
    print(paths["json"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
