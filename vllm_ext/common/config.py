"""Frozen, validated configuration for every vllm_ext system.

Each system declares one ``@dataclass(frozen=True)`` whose fields are made by
:func:`option`: a default, a ``doc`` (shown in config tables and errors) and
whether the field is ``experimental`` (an ablation switch or a calibrated
constant rather than a setting a user needs). Users write a system's settings
as its block of vLLM's ``--additional-config``, public keys at the top and
experimental ones only inside ``"experimental"``::

    {"leap": {"weights_path": "w.npz", "experimental": {"risk_k": 1.0}}}

:func:`load_config` builds the dataclass from, in order of precedence:

1. that block;
2. environment variables ``VLLMEXT_<SYSTEM>_<FIELD>`` (any field, no nesting);
3. the field defaults.

Unknown keys, in the block or the environment, and keys on the wrong side of
``"experimental"`` are errors naming the key and the valid ones: a typo must
never silently fall back to a default. The retired prefix ``VLLM_EXT_`` is an
error naming the new variable (vLLM 0.34 refuses unknown ``VLLM_*`` variables).

Plain dataclasses, not pydantic: algorithm modules build these directly, and
``vllm-ext serve`` validates them before vLLM starts, where a millisecond
check with one-line errors matters more than a schema library.
Algorithm modules import this file, so it never imports vLLM.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

ENV_PREFIX = "VLLMEXT_"
OLD_ENV_PREFIX = "VLLM_EXT_"
EXPERIMENTAL = "experimental"

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration value or key is invalid; the message names it."""


# what a path-valued option names, which must exist before vLLM starts (check_paths)
PATH_KINDS = {"file": "file", "dir": "folder"}


def option(
    default: Any = dataclasses.MISSING,
    *,
    doc: str,
    experimental: bool = False,
    path: str | None = None,
    not_paths: tuple[str, ...] = (),
    **kwargs: Any,
) -> Any:
    """A dataclass field with its documentation; ``experimental`` fields nest in the block.

    ``path``: ``"file"`` or ``"dir"`` for a setting that names an existing file or folder
    (``not_paths``: its values that are not paths, e.g. ``"identity"``); :func:`check_paths`
    refuses a missing one before vLLM starts.
    """
    if isinstance(default, (list, dict, set)):
        raise TypeError("use a tuple or default_factory for mutable defaults")
    if path is not None and path not in PATH_KINDS:
        raise TypeError(f"path must be one of {sorted(PATH_KINDS)}, got {path!r}")
    metadata = {"doc": doc, "experimental": experimental}
    if path is not None:
        metadata.update(path=path, not_paths=tuple(not_paths))
    return dataclasses.field(default=default, metadata=metadata, **kwargs)


def path_fields(cls: type) -> list[dataclasses.Field]:
    """The fields of ``cls`` that name an existing file or folder."""
    return [f for f in dataclasses.fields(cls) if f.metadata.get("path")]


def check_paths(config: Any, system: str) -> None:
    """Raise naming the first path-valued setting of ``config`` whose file or folder is missing.

    Separate from the dataclass's own checks: algorithm code and tests build configs
    for files written later; ``vllm-ext serve`` and ``vllm serve`` call this before
    vLLM starts, so a typo in a path is one line, not a traceback deep into start-up.
    """
    for f in path_fields(type(config)):
        value = getattr(config, f.name)
        if value is None or value in f.metadata["not_paths"]:
            continue
        kind = f.metadata["path"]
        exists = os.path.isfile(value) if kind == "file" else os.path.isdir(value)
        if not exists:
            where = f'additional_config["{system}"]'
            if is_experimental(f):
                where += f'["{EXPERIMENTAL}"]'
            other = "folder" if os.path.isdir(value) else "file" if os.path.exists(value) else None
            found = f" (it is a {other})" if other else ""
            relative = "" if os.path.isabs(value) else f" (relative to {os.getcwd()})"
            raise ConfigError(
                f"{where}.{f.name}: no such {PATH_KINDS[kind]} {value!r}{found}{relative}"
            )


def is_experimental(f: dataclasses.Field) -> bool:
    return bool(f.metadata.get("experimental", False))


def env_var_name(system: str, field_name: str) -> str:
    """``("leap", "layer")`` → ``"VLLMEXT_LEAP_LAYER"``."""
    return f"{ENV_PREFIX}{system.upper()}_{field_name.upper()}"


def load_config(
    cls: type[T],
    system: str,
    mapping: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> T:
    """Build ``cls`` from the system's block, then env vars, then defaults.

    Args:
        cls: a frozen dataclass type.
        system: short system name; selects the ``VLLMEXT_<SYSTEM>_`` env vars.
        mapping: the system's block: public field names, plus experimental
            ones inside ``mapping["experimental"]``.
        environ: environment to read. Default: ``os.environ``.

    Returns:
        The validated instance; ``cls.__post_init__`` runs its own checks.
    """
    _require_frozen_dataclass(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    given = flatten_block(cls, system, mapping)
    env_values = _read_env(system, fields, os.environ if environ is None else environ)
    hints = typing.get_type_hints(cls)
    values = {
        name: coerce(value, hints[name], f"{cls.__name__}.{name}")
        for name, value in {**env_values, **given}.items()
    }
    try:
        return cls(**values)
    except TypeError as exc:
        raise ConfigError(f"{cls.__name__}: {exc}") from exc


def flatten_block(cls: type, system: str, block: Any) -> dict[str, Any]:
    """A system's block → ``{field: value}``, checking every key and its nesting."""
    where = f'additional_config["{system}"]'
    block = _require_mapping(block or {}, where)
    public = {f.name for f in dataclasses.fields(cls) if f.init and not is_experimental(f)}
    hidden = {f.name for f in dataclasses.fields(cls) if f.init and is_experimental(f)}
    top = dict(block)
    nested = _require_mapping(top.pop(EXPERIMENTAL, None) or {}, f'{where}["{EXPERIMENTAL}"]')
    if moved := sorted(set(top) & hidden):
        raise ConfigError(
            f"{_names(moved)} in {where} is experimental: write it inside "
            f'{where}["{EXPERIMENTAL}"] (public keys: {_names(public)})'
        )
    if moved := sorted(set(nested) & public):
        raise ConfigError(
            f'{_names(moved)} in {where}["{EXPERIMENTAL}"] is a public key: write it '
            f"directly in {where}"
        )
    valid = sorted(public) + ([EXPERIMENTAL] if hidden else [])
    _reject_unknown(top, valid, f"key {{}} in {where}")
    _reject_unknown(nested, sorted(hidden), f'experimental key {{}} in {where}["{EXPERIMENTAL}"]')
    return {**top, **nested}


def config_block(cls: type, values: Mapping[str, Any]) -> dict[str, Any]:
    """``{field: value}`` → the system's block, experimental fields nested (the reverse)."""
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    _reject_unknown(values, sorted(fields), f"field {{}} of {cls.__name__}")
    block = {k: v for k, v in values.items() if not is_experimental(fields[k])}
    nested = {k: v for k, v in values.items() if is_experimental(fields[k])}
    return {**block, EXPERIMENTAL: nested} if nested else block


def reject_old_env(environ: Mapping[str, str], prefix: str = OLD_ENV_PREFIX) -> None:
    """Raise naming the new name of every ``VLLM_EXT_*`` variable (starting with ``prefix``)."""
    old = sorted(key for key in environ if key.startswith(prefix))
    if old:
        renames = ", ".join(f"{key} -> {renamed_env(key)}" for key in old)
        raise ConfigError(
            f"vllm_ext no longer reads {_names(old)}: rename {renames} "
            "(vLLM >= 0.34 refuses unknown VLLM_* variables)"
        )


def renamed_env(old: str) -> str:
    """``VLLM_EXT_LEAP_LAYER`` → ``VLLMEXT_LEAP_LAYER``."""
    return ENV_PREFIX + old.removeprefix(OLD_ENV_PREFIX)


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for a close match, else ``""``."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _names(names: Iterable[str]) -> str:
    return ", ".join(map(repr, sorted(names))) or "(none)"


def _require_mapping(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where} must be a JSON object, got {value!r}")
    return value


def _require_frozen_dataclass(cls: type) -> None:
    if not dataclasses.is_dataclass(cls) or not cls.__dataclass_params__.frozen:
        raise TypeError(f"{cls.__name__} must be a frozen dataclass")


def _reject_unknown(keys: Iterable[str], valid: list[str], what: str) -> None:
    unknown = sorted(set(keys) - set(valid))
    if unknown:
        hint = did_you_mean(unknown[0], valid) if len(unknown) == 1 else ""
        raise ConfigError(
            f"unknown {what.format(_names(unknown))}{hint}; valid: {', '.join(valid) or '(none)'}"
        )


def _read_env(system: str, fields: Mapping[str, Any], environ: Mapping[str, str]):
    reject_old_env(environ, f"{OLD_ENV_PREFIX}{system.upper()}_")
    prefix = f"{ENV_PREFIX}{system.upper()}_"
    found = {
        key[len(prefix) :].lower(): val for key, val in environ.items() if key.startswith(prefix)
    }
    allowed = [env_var_name(system, name) for name in sorted(fields)]
    _reject_unknown(
        [env_var_name(system, name) for name in found], allowed, "environment variable {}"
    )
    return {name: _EnvText(text) for name, text in found.items()}


class _EnvText(str):
    """Raw text of an env var; :func:`coerce` also tries it as JSON (numbers, lists, null)."""


def coerce(value: Any, hint: Any, where: str) -> Any:
    """Check ``value`` against the type ``hint``, converting where lossless."""
    if isinstance(value, _EnvText):
        try:
            return coerce(str(value), hint, where)
        except ConfigError:
            try:
                parsed = json.loads(value)
            except json.JSONDecodeError:
                raise ConfigError(f"{where}: cannot parse {str(value)!r}") from None
            return coerce(parsed, hint, where)
    origin = typing.get_origin(hint)
    if hint is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        return _coerce_union(value, typing.get_args(hint), where)
    if origin is typing.Literal:
        choices = typing.get_args(hint)
        if value not in choices:
            raise ConfigError(f"{where} must be one of {list(choices)}, got {value!r}")
        return value
    if origin is tuple:
        return _coerce_tuple(value, typing.get_args(hint), where)
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
            return value.lower() in ("true", "1")
        raise ConfigError(f"{where} must be a boolean, got {value!r}")
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    # bool is an int subclass; True as a count is a typo, not a value
    if isinstance(hint, type) and (
        not isinstance(value, hint) or (isinstance(value, bool) and hint in (int, float))
    ):
        raise ConfigError(f"{where} must be {hint.__name__}, got {value!r}")
    return value


def _coerce_union(value: Any, options: tuple[Any, ...], where: str) -> Any:
    if value is None and type(None) in options:
        return None
    errors = []
    for option_hint in options:
        if option_hint is type(None):
            continue
        try:
            return coerce(value, option_hint, where)
        except ConfigError as exc:
            errors.append(str(exc))
    raise ConfigError("; ".join(errors) or f"{where}: invalid value {value!r}")


def _coerce_tuple(value: Any, args: tuple[Any, ...], where: str) -> tuple[Any, ...]:
    if isinstance(value, str):
        value = [part.strip() for part in value.split(",") if part.strip()]
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{where} must be a list, got {value!r}")
    item_hint = args[0] if args else Any
    return tuple(coerce(item, item_hint, f"{where}[{i}]") for i, item in enumerate(value))


def config_table(cls: type, system: str, experimental: bool = False) -> str:
    """Markdown table of ``cls``'s public (or experimental) fields: key, type, default, env var,
    meaning."""
    hints = typing.get_type_hints(cls)
    rows = ["| Key | Type | Default | Env var | Meaning |", "|---|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        if is_experimental(f) != experimental:
            continue
        default = repr(f.default) if f.default is not dataclasses.MISSING else "required"
        hint = hints[f.name]
        # a Literal's __name__ is just "Literal": show its choices
        named = typing.get_origin(hint) is not typing.Literal
        type_name = (getattr(hint, "__name__", None) if named else None) or str(hint)
        doc = f.metadata.get("doc", "")
        if f.metadata.get("path"):
            doc += f" (an existing {PATH_KINDS[f.metadata['path']]}: checked before vLLM starts)"
        env = env_var_name(system, f.name)
        cells = (f"`{f.name}`", f"`{type_name.replace('typing.', '')}`", f"`{default}`", f"`{env}`")
        # GitHub tables split cells at every "|", even inside code spans, unless escaped
        row = " | ".join(cell.replace("|", "\\|") for cell in (*cells, doc))
        rows.append(f"| {row} |")
    return "\n".join(rows)
