"""Whether LEAP may start on this vLLM: its probe is tested on the V1 model runner only.

vLLM 0.34 removed the V1 runner, and vLLM 0.33 on CUDA runs Model Runner V2 by
default. LEAP's V2 path (:class:`~vllm_ext.leap.batch_layout.V2StepLayout`) is
tested on V2's structures on CPU, never in a V2 engine, so it runs only when
the user opts in (``experimental.model_runner_v2``); otherwise LEAP refuses
with one line. ``vllm-ext serve`` and LEAP's plugin ask before vLLM starts
(:func:`refuse_serve`); the loader asks again when the engine itself runs V2.
Imports no vLLM.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence

from vllm_ext.common import compat
from vllm_ext.common.config import load_config
from vllm_ext.common.systems import additional_config_from_argv
from vllm_ext.leap.config import SYSTEM, LeapConfig

OPT_IN = """--additional-config '{"leap": {"experimental": {"model_runner_v2": true}}}'"""


def refusal(
    config: LeapConfig, v1_present: bool, version: str | None, engine_on_v2: bool = False
) -> str | None:
    """Why LEAP must not start; None when it may.

    Args:
        config: LEAP's settings (``model_runner_v2`` is the opt-in).
        v1_present: whether the installed vLLM ships the V1 runner
            (:func:`vllm_ext.common.compat.has_v1_runner`).
        version: the installed vLLM's version, for the message.
        engine_on_v2: the engine runs Model Runner V2 although V1 is there.
    """
    if config.model_runner_v2:
        return None
    if not v1_present:
        return (
            f"LEAP needs vLLM's V1 model runner, which vLLM {version or '(unknown)'} no longer "
            "ships (removed in 0.34), and its Model Runner V2 path is untested in an engine: "
            f"use vLLM 0.32 or 0.33, or opt in to the experimental V2 path with {OPT_IN}"
        )
    if engine_on_v2:
        return (
            "this engine runs Model Runner V2, where LEAP's probe is untested in an engine: "
            "set VLLM_USE_V2_MODEL_RUNNER=0 for the V1 runner, or opt in to the experimental "
            f"V2 path with {OPT_IN}"
        )
    return None


def installed_refusal(config: LeapConfig) -> str | None:
    """:func:`refusal` for the installed vLLM, found without importing it."""
    return refusal(config, compat.has_v1_runner(), compat.installed_vllm_version())


def selects_leap(args: Sequence[str]) -> bool:
    """Whether ``vllm serve`` arguments enable LEAP (its load format, scheduler or connector)."""
    for i, arg in enumerate(args):
        name, has_value, value = arg.partition("=")
        if name.replace("_", "-") == "--load-format":
            if not has_value:
                value = args[i + 1] if i + 1 < len(args) else ""
            if value == "leap":
                return True
        if "vllm_ext.leap" in arg or "LeapConnector" in arg:
            return True
    return False


def refuse_serve(argv: Sequence[str], environ: Mapping[str, str] = os.environ) -> None:
    """In a ``vllm serve`` process that enables LEAP, exit with one line if LEAP may not start.

    Runs where vLLM loads LEAP's general plugin, before it parses its
    arguments (as :func:`~vllm_ext.common.systems.validate_serve_argv`, which
    has checked the config by then): exit status 2, as an argparse error.
    """
    if len(argv) < 2 or argv[1] != "serve" or not selects_leap(argv[2:]):
        return
    block = (additional_config_from_argv(argv[2:]) or {}).get(SYSTEM)
    problem = installed_refusal(load_config(LeapConfig, SYSTEM, block, environ))
    if problem is not None:
        sys.stderr.write(f"vllm serve: error: {problem}\n")
        sys.stderr.flush()
        raise SystemExit(2)
