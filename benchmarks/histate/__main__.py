"""HiState benchmarks entry point.

``python -m benchmarks.histate --sim [args]`` runs the calibrated simulator
benchmark (same as ``python -m benchmarks.histate.sim``); the in-engine
benchmark is not part of this module yet.
"""

from __future__ import annotations

import sys

from benchmarks.histate import sim


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--sim" not in argv:
        sys.stderr.write("usage: python -m benchmarks.histate --sim [--quick] [--out DIR]\n")
        return 2
    argv.remove("--sim")
    return sim.main(argv)


if __name__ == "__main__":
    sys.exit(main())
