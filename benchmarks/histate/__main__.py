"""HiState benchmarks entry point.

``python -m benchmarks.histate --sim [args]``: the calibrated simulator
(``benchmarks.histate.sim``); ``python -m benchmarks.histate --engine [args]``:
the policies side by side in a real vLLM engine (``benchmarks.histate.engine``).
"""

from __future__ import annotations

import sys

USAGE = "usage: python -m benchmarks.histate (--sim | --engine) [--quick] [--out DIR]\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--sim" in argv:
        from benchmarks.histate import sim

        argv.remove("--sim")
        return sim.main(argv)
    if "--engine" in argv:
        from benchmarks.histate import engine

        argv.remove("--engine")
        return engine.main(argv)
    sys.stderr.write(USAGE)
    return 2


if __name__ == "__main__":
    sys.exit(main())
