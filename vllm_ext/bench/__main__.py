"""Command line of the benchmark harness.

``python -m vllm_ext.bench compare A.json B.json [--threshold 0.05]`` prints
a diff table and exits 1 when a regression is flagged (0 otherwise).
``python -m vllm_ext.bench fingerprint`` prints this machine's fingerprint.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

logger = logging.getLogger(__name__)


def _emit(text: str) -> None:
    """Write CLI output to stdout."""
    sys.stdout.write(text + "\n")


def _parser() -> argparse.ArgumentParser:
    """Argument parser with the ``compare`` and ``fingerprint`` subcommands."""
    parser = argparse.ArgumentParser(
        prog="python -m vllm_ext.bench", description=__doc__.splitlines()[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    cmp_p = sub.add_parser("compare", help="compare two result JSON files")
    cmp_p.add_argument("a", type=Path, help="reference result JSON")
    cmp_p.add_argument("b", type=Path, help="candidate result JSON")
    cmp_p.add_argument(
        "--threshold",
        type=float,
        default=0.05,
        help="relative change flagged as regression (0.05 = 5%%)",
    )
    cmp_p.add_argument(
        "--regressions-only",
        action="store_true",
        help="list only flagged rows and fingerprint differences",
    )
    fp_p = sub.add_parser("fingerprint", help="print this machine's fingerprint")
    fp_p.add_argument("--no-torch", action="store_true", help="skip importing torch")
    return parser


def _cmd_compare(args: argparse.Namespace) -> int:
    """Run ``compare``; returns the exit code."""
    from vllm_ext.bench.compare import compare, format_diffs, regressions

    try:
        a = json.loads(args.a.read_text(encoding="utf-8"))
        b = json.loads(args.b.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        logger.error("cannot read results: %s", exc)
        return 2
    diffs = compare(a, b, threshold=args.threshold)
    if args.regressions_only:
        diffs = [d for d in diffs if d.regression or d.kind == "fingerprint"]
    _emit(f"compare {args.a} -> {args.b} (threshold {args.threshold:.1%})")
    _emit(format_diffs(diffs))
    return 1 if regressions(diffs) else 0


def _cmd_fingerprint(args: argparse.Namespace) -> int:
    """Run ``fingerprint``; returns the exit code."""
    from vllm_ext.bench.fingerprint import collect_fingerprint

    _emit(
        json.dumps(
            collect_fingerprint(include_torch=not args.no_torch),
            indent=2,
            sort_keys=True,
            default=str,
        )
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the process exit code."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    args = _parser().parse_args(argv)
    if args.command == "compare":
        return _cmd_compare(args)
    return _cmd_fingerprint(args)


if __name__ == "__main__":
    sys.exit(main())
