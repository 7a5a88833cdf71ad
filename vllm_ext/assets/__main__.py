"""Build (idempotently) and check the model assets: ``python -m vllm_ext.assets [NAME ...]``.

``--path`` prints only each asset's folder, one per line, for shell use:
``MODEL=$(python -m vllm_ext.assets --path smollm2)``.
"""

from __future__ import annotations

import argparse
import sys

from vllm_ext.assets.models import MODELS, model_path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vllm_ext.assets", description=__doc__)
    parser.add_argument(
        "names", nargs="*", help=f"assets to build (default: all of {', '.join(MODELS)})"
    )
    parser.add_argument("--verify", action="store_true", help="re-hash existing files")
    parser.add_argument("--force", action="store_true", help="rebuild even when present")
    parser.add_argument(
        "--path", action="store_true", help="print only the folders (built first if missing)"
    )
    args = parser.parse_args(argv)
    names = args.names or list(MODELS)
    unknown = [name for name in names if name not in MODELS]
    if unknown:
        parser.error(f"unknown asset(s) {', '.join(unknown)}; available: {', '.join(MODELS)}")
    if args.path:
        for name in names:
            sys.stdout.write(f"{model_path(name, verify=args.verify, force=args.force)}\n")
        return 0
    from tqdm import tqdm

    with tqdm(names, desc="assets", unit="asset") as bar:
        for name in bar:
            bar.set_postfix_str(name)
            path = model_path(name, verify=args.verify, force=args.force)
            tqdm.write(f"{name:12s} {path}  ({MODELS[name].about})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
