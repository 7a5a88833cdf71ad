"""``vllm-ext`` command: ``serve`` (vllm serve with ``--plugins``), ``demo``,
``assets``, ``bench``, ``memx``.

``vllm-ext serve MODEL --plugins leap,histate [any vllm serve args]`` checks
``--additional-config`` and the ``VLLMEXT_*`` variables (a bad key exits with
status 2 and one line, before vLLM is imported), prints the equivalent plain
``vllm serve`` command, then replaces itself with it (signals and exit codes
are vLLM's own). ``--dry-run`` prints only.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

from vllm_ext.common import parallel_gate
from vllm_ext.common.config import ConfigError
from vllm_ext.common.systems import (
    additional_config_from_argv,
    check_config_paths,
    validate_additional_config,
)
from vllm_ext.histate.folder_safety import folder_refusal
from vllm_ext.launcher import SYSTEMS, LaunchError, compose, parse_plugin_list
from vllm_ext.leap import runner_gate
from vllm_ext.patches import vllm_cpu_cli_version


def _emit(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def _vllm_cli_argv() -> list[str]:
    # vLLM's own CLI, through vllm_ext.vllm_main: on a vllm-cpu install plain
    # `vllm` cannot start (patches/vllm_cpu_cli_version.py); elsewhere it is the same
    return [sys.executable, "-m", "vllm_ext.vllm_main"]


def _general_plugin_names() -> list[str]:
    from importlib.metadata import entry_points

    return [ep.name for ep in entry_points(group="vllm.general_plugins")]


def _plain_text(doc: str) -> str:
    """A reST docstring as a terminal shows it: ``code`` and :role:`target` lose their markup."""
    doc = re.sub(r":\w+:`~?([^`]+)`", r"\1", doc)
    return doc.replace("``", "")


def _is_help(arg: str) -> bool:
    return arg in ("-h", "--help") or arg.startswith("--help=")


def serve(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="vllm-ext serve",
        description="vllm serve with vllm_ext systems enabled by name",
        epilog="All other arguments go to vllm serve unchanged; its own help follows.",
        add_help=False,
    )
    parser.add_argument("model")
    valid = ", ".join(sorted(SYSTEMS)) or "(none yet)"
    parser.add_argument("--plugins", default="", help=f"comma-separated systems: {valid}")
    parser.add_argument("--dry-run", action="store_true", help="print the command, do not run it")
    parser.add_argument(
        "-h", "--help", action="store_true", help="this help, then vllm serve's (--help=...: its)"
    )
    if any(_is_help(arg) for arg in argv):
        # ours first, then vLLM's own options: every one of them passes through
        _emit(parser.format_help())
        helps = [arg for arg in argv if _is_help(arg)]
        return subprocess.call([*_vllm_cli_argv(), "serve", *helps])
    args, vllm_args = parser.parse_known_args(argv)
    try:
        configs = validate_additional_config(
            additional_config_from_argv(vllm_args) or {}, os.environ
        )
        check_config_paths(configs)
    except ConfigError as exc:
        # one line, before vLLM is imported: the config is the user's to fix, not a crash
        sys.stderr.write(f"vllm-ext serve: error: {exc}\n")
        return 2
    try:
        plugins = parse_plugin_list(args.plugins, SYSTEMS)
        plan = compose(args.model, plugins, vllm_args, os.environ, _general_plugin_names())
    except LaunchError as exc:
        parser.error(str(exc))
    refused = runner_gate.argv_refusal(vllm_args) if "leap" in plugins else None
    if refused is None and "histate" in plugins:
        # a folder others could write may already hold planted snapshots: refuse before vLLM
        refused = folder_refusal(configs["histate"])
    if refused is None:
        # ACCT/ARK on several ranks, ETAPS row-parallel, Flide pipeline-parallel
        refused = parallel_gate.refusal(plan.argv[2:])
    if refused is not None:
        sys.stderr.write(f"vllm-ext serve: error: {refused}\n")
        return 2
    _emit("Equivalent command:\n  " + plan.shell())
    if vllm_cpu_cli_version.needed():
        _emit(
            "  (vllm-cpu 0.32 cannot start plain `vllm`: use `python -m vllm_ext.vllm_main` "
            "in its place; see patches/README.md)"
        )
    if args.dry_run:
        return 0
    argv = [*_vllm_cli_argv(), *plan.argv[1:]]
    os.execve(sys.executable, argv, {**os.environ, **plan.env})
    return 0  # not reached


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    commands = {"serve": serve, "demo": _demo, "assets": _assets, "bench": _bench, "memx": _memx}
    if not argv or argv[0] not in commands:
        _emit(f"usage: vllm-ext {{{','.join(commands)}}} ...\n\n{_plain_text(__doc__)}")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return commands[argv[0]](argv[1:])


def _demo(argv: list[str]) -> int:
    from vllm_ext.demo import main as demo_main

    return demo_main(argv)


def _assets(argv: list[str]) -> int:
    from vllm_ext.assets.__main__ import main as assets_main

    return assets_main(argv)


def _memx(argv: list[str]) -> int:
    from vllm_ext.memx.cli import main as memx_main

    return memx_main(argv)


def _bench(argv: list[str]) -> int:
    from vllm_ext.bench.__main__ import main as bench_main

    return bench_main(argv)


if __name__ == "__main__":
    sys.exit(main())
