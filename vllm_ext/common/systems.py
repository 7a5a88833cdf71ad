"""The systems' configs, and validation of a whole ``--additional-config`` before vLLM starts.

:data:`SYSTEM_CONFIGS` maps each system's key in ``--additional-config`` to
its config dataclass (``"module:Class"``, imported only when used; a new
system adds its line here). :func:`validate_additional_config` checks the
whole dict and every ``VLLMEXT_*`` variable; ``vllm-ext serve`` runs it before
``execve`` and the general plugins run it when vLLM loads them (see
:func:`validate_serve_argv`). Inside an engine each system reads its block with
:func:`config_from_vllm`. Imports no vLLM: it runs before vLLM is imported.
"""

from __future__ import annotations

import difflib
import importlib
import json
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

from vllm_ext.common import parallel_gate
from vllm_ext.common.argv import exit_serve_error
from vllm_ext.common.config import (
    ENV_PREFIX,
    ConfigError,
    check_paths,
    did_you_mean,
    load_config,
    reject_old_env,
)

SYSTEM_CONFIGS: dict[str, str] = {
    "leap": "vllm_ext.leap.config:LeapConfig",
    "histate": "vllm_ext.histate.config:HiStateConfig",
    "flide": "vllm_ext.flide.config:FlideConfig",
    "ark": "vllm_ext.ark.config:ArkConfig",
    "acct": "vllm_ext.acct.config:AcctConfig",
    "etaps": "vllm_ext.etaps.config:EtapsConfig",
    "tvq": "vllm_ext.tvq.config:TvqConfig",
}

# our variables that belong to no system's config
OTHER_ENV: dict[str, str] = {
    "VLLMEXT_ASSETS_DIR": "folder of the built models and weights "
    "(default ~/.cache/vllm_ext/assets)",
    "VLLMEXT_KERNELS_FORCE_REF": "1 = every vllm_ext kernel runs its fp32 reference",
}

OPTION = "--additional-config"


def config_class(system: str) -> type:
    """The config dataclass of ``system`` (a key of :data:`SYSTEM_CONFIGS`)."""
    module, _, name = SYSTEM_CONFIGS[system].partition(":")
    return getattr(importlib.import_module(module), name)


def validate_additional_config(
    additional: Mapping[str, Any], environ: Mapping[str, str] = os.environ
) -> dict[str, object]:
    """Check ``--additional-config`` and the environment for every system.

    Keys that are not a system's are left to vLLM and other plugins (vLLM
    itself writes e.g. ``gdn_prefill_backend`` there), except near-misses of a
    system's name (``"leapp"``, ``"HiState"``, ``"leap_config"``), which are errors.

    Args:
        additional: the parsed ``--additional-config`` dict.
        environ: environment to check. Default: ``os.environ``.

    Returns:
        ``{system: config}`` for every registered system (defaults where unset).

    Raises:
        ConfigError: one line naming the bad key or variable and the valid ones.
    """
    if not isinstance(additional, Mapping):
        raise ConfigError(f"{OPTION} must be a JSON object, got {additional!r}")
    reject_old_env(environ)
    _reject_unknown_env(environ)
    for key in additional:
        _reject_near_miss(str(key))
    return {
        system: load_config(config_class(system), system, additional.get(system), environ)
        for system in SYSTEM_CONFIGS
    }


def check_config_paths(configs: Mapping[str, object]) -> None:
    """Every path-valued setting of ``configs`` (:func:`validate_additional_config`'s result)
    names an existing file or folder; raises :class:`ConfigError` naming the first that does not.
    """
    for system, config in configs.items():
        check_paths(config, system)


def config_from_vllm(system: str, vllm_config: Any) -> Any:
    """``system``'s config from a ``VllmConfig`` (duck-typed: no vLLM import).

    ``additional_config`` reaches every vLLM process (API server, scheduler,
    workers), so every side of a system reads the same block.
    """
    additional = getattr(vllm_config, "additional_config", None) or {}
    # a platform plugin may pass an object of its own here instead of a dict
    block = additional.get(system) if isinstance(additional, Mapping) else None
    return load_config(config_class(system), system, block)


def _reject_near_miss(key: str) -> None:
    if key in SYSTEM_CONFIGS:
        return
    lowered = key.lower()
    close = difflib.get_close_matches(lowered, list(SYSTEM_CONFIGS), n=1, cutoff=0.75)
    # a system name inside a longer key: "leap_config", "histate-settings" (not "ark" in "mark")
    contained = [name for name in SYSTEM_CONFIGS if len(name) >= 4 and name in lowered]
    if close or contained:
        raise ConfigError(
            f"unknown system {key!r} in {OPTION} (did you mean {(close or contained)[0]!r}?); "
            f"systems: {', '.join(sorted(SYSTEM_CONFIGS))}"
        )


def _reject_unknown_env(environ: Mapping[str, str]) -> None:
    prefixes = [f"{ENV_PREFIX}{system.upper()}_" for system in SYSTEM_CONFIGS]
    for key in sorted(environ):
        if not key.startswith(ENV_PREFIX) or key in OTHER_ENV:
            continue
        if not any(key.startswith(prefix) for prefix in prefixes):
            valid = [p + "<FIELD>" for p in prefixes] + sorted(OTHER_ENV)
            raise ConfigError(
                f"unknown environment variable {key!r}{did_you_mean(key, OTHER_ENV)}; "
                f"valid: {', '.join(valid)}"
            )


def additional_config_from_argv(args: Sequence[str]) -> dict[str, Any] | None:
    """The ``--additional-config`` that vLLM 0.32's argument parser would build from ``args``.

    Like vLLM's ``FlexibleArgumentParser``: ``--additional-config JSON`` or
    ``=JSON`` (``_`` for ``-`` too; the last one wins), and dotted keys
    (``--additional-config.leap.weights_path w.npz``), which vLLM merges into
    one dict that replaces any plain value. A ``--config`` YAML file is not
    read here: its blocks are checked when each system loads them, at engine
    start. None = not given.

    Raises:
        ConfigError: a value that is not a JSON object (vLLM 0.32 reads no file path here).
    """
    plain: str | None = None
    dotted: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        name, has_value, value = arg.partition("=")
        # vLLM reads "_" as "-" in the option's name, not in the dotted keys after it
        head, dot, keys = name.partition(".")
        name = head.replace("_", "-") + dot + keys
        if name == OPTION or name.startswith(OPTION + "."):
            if not has_value:
                if i + 1 >= len(args):
                    raise ConfigError(f"{name} needs a value")
                value = args[i + 1]
                i += 1
            if name == OPTION:
                plain = value
            else:
                _set_dotted(dotted, name[len(OPTION) + 1 :].split("."), value)
        i += 1
    if dotted:
        return dotted
    return None if plain is None else _parse_object(plain)


def _parse_object(text: str) -> dict[str, Any]:
    # vLLM 0.32 parses only "{...}" as JSON; other text fails later, in VllmConfig
    if not re.match(r"(?s)^\s*{.*}\s*$", text):
        raise ConfigError(
            f"{OPTION} must be a JSON object such as '{{\"leap\": {{...}}}}' (vLLM 0.32 reads "
            f"no file path here), got {text!r}"
        )
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{OPTION} is not valid JSON ({exc}): {text!r}") from None


def _set_dotted(target: dict[str, Any], keys: list[str], text: str) -> None:
    # vLLM reads each dotted value as JSON, else keeps the text; "key+" takes a list
    if keys[-1].endswith("+"):
        keys = [*keys[:-1], keys[-1][:-1]]
        text = json.dumps(text.split(","))
    try:
        value: Any = json.loads(text)
    except json.JSONDecodeError:
        value = _human_readable_int(text)
    for key in keys[:-1]:
        target = target.setdefault(key, {})
        if not isinstance(target, dict):
            raise ConfigError(f"{OPTION}.{'.'.join(keys)} conflicts with a value set before")
    target[keys[-1]] = value


_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_SUFFIXES.update({"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40})


def _human_readable_int(text: str) -> Any:
    """``"8G"`` → 8 * 2**30, ``"1.5k"`` → 1500, as vLLM reads dotted values; else the text."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", text.strip())
    if not match:
        return text
    number, suffix = match.groups()
    if suffix.isupper() and "." in number:
        return text  # vLLM refuses decimals with binary suffixes
    return int(float(number) * _SUFFIXES[suffix])


_validated = False


def validate_serve_argv(argv: Sequence[str], environ: Mapping[str, str] = os.environ) -> None:
    """In a ``vllm serve`` process, check its ``--additional-config`` once; exit on an error.

    vLLM loads general plugins before it parses its arguments (to let plugins
    add choices), in the API server and again in each child process (whose
    ``sys.argv`` is the parent's), so this is the earliest point a plugin sees
    the user's config under plain ``vllm serve``. A bad config ends the process
    with one line on stderr and exit status 2, as an argparse error would; so
    does a system that refuses the tensor/pipeline parallel sizes asked for
    (:mod:`vllm_ext.common.parallel_gate`).
    Other processes (an offline ``LLM``, pytest) check at engine start instead.
    """
    global _validated
    if _validated or len(argv) < 2 or argv[1] != "serve":
        return
    _validated = True
    try:
        additional = additional_config_from_argv(argv[2:])
        check_config_paths(validate_additional_config(additional or {}, environ))
    except ConfigError as exc:
        exit_serve_error(exc)
    # a system that cannot run on this many ranks: one line now, not a worker's traceback later
    parallel_gate.refuse_serve(argv)
