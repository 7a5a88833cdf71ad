"""Frozen, validated configuration for every vllm_ext system.

Each system declares one ``@dataclass(frozen=True)`` whose fields carry a
``doc`` in their metadata (use :func:`option`). :func:`load_config` builds it
from, in order of precedence:

1. an explicit mapping (``kv_connector_extra_config``, ``--additional-config``);
2. environment variables ``VLLM_EXT_<SYSTEM>_<FIELD>``;
3. the field defaults.

Unknown keys, in the mapping or in the environment, are errors naming the key
and the allowed ones: a typo must never silently fall back to a default.
Algorithm modules import this file, so it never imports vLLM.
"""

from __future__ import annotations

import dataclasses
import json
import os
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

ENV_PREFIX = "VLLM_EXT_"

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration value or key is invalid; the message names it."""


def option(default: Any = dataclasses.MISSING, *, doc: str, **kwargs: Any) -> Any:
    """A dataclass field with its documentation (shown in config tables and errors)."""
    if isinstance(default, (list, dict, set)):
        raise TypeError("use a tuple or default_factory for mutable defaults")
    return dataclasses.field(default=default, metadata={"doc": doc}, **kwargs)


def env_var_name(system: str, field_name: str) -> str:
    """``("leap", "layer")`` → ``"VLLM_EXT_LEAP_LAYER"``."""
    return f"{ENV_PREFIX}{system.upper()}_{field_name.upper()}"


def load_config(
    cls: type[T],
    system: str,
    mapping: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> T:
    """Build ``cls`` from ``mapping``, then env vars, then defaults.

    Args:
        cls: a frozen dataclass type.
        system: short system name; selects the ``VLLM_EXT_<SYSTEM>_`` env vars.
        mapping: explicit settings; keys must be field names.
        environ: environment to read. Default: ``os.environ``.

    Returns:
        The validated instance; ``cls.__post_init__`` runs its own checks.
    """
    _require_frozen_dataclass(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    mapping = dict(mapping or {})
    _reject_unknown(cls.__name__, mapping.keys(), fields, "key")
    env_values = _read_env(cls.__name__, system, fields, os.environ if environ is None else environ)
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for name, value in {**env_values, **mapping}.items():
        values[name] = coerce(value, hints[name], f"{cls.__name__}.{name}")
    try:
        return cls(**values)
    except TypeError as exc:
        raise ConfigError(f"{cls.__name__}: {exc}") from exc


def _require_frozen_dataclass(cls: type) -> None:
    if not dataclasses.is_dataclass(cls) or not cls.__dataclass_params__.frozen:
        raise TypeError(f"{cls.__name__} must be a frozen dataclass")


def _reject_unknown(owner: str, keys: typing.Iterable[str], fields: Mapping[str, Any], what: str):
    unknown = sorted(set(keys) - set(fields))
    if unknown:
        allowed = ", ".join(sorted(fields)) or "(none)"
        raise ConfigError(
            f"unknown {what} {', '.join(map(repr, unknown))} for {owner}; allowed: {allowed}"
        )


def _read_env(owner: str, system: str, fields: Mapping[str, Any], environ: Mapping[str, str]):
    prefix = f"{ENV_PREFIX}{system.upper()}_"
    found = {
        key[len(prefix) :].lower(): val for key, val in environ.items() if key.startswith(prefix)
    }
    unknown = sorted(set(found) - set(fields))
    if unknown:
        names = ", ".join(prefix + name.upper() for name in unknown)
        allowed = ", ".join(env_var_name(system, name) for name in sorted(fields))
        raise ConfigError(f"unknown environment variable {names} for {owner}; allowed: {allowed}")
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
    if isinstance(hint, type) and not (
        isinstance(value, hint) and not _is_bool_for_number(value, hint)
    ):
        raise ConfigError(f"{where} must be {hint.__name__}, got {value!r}")
    return value


def _is_bool_for_number(value: Any, hint: type) -> bool:
    return isinstance(value, bool) and hint in (int, float)


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


def config_table(cls: type, system: str) -> str:
    """Markdown table of ``cls``'s fields: key, type, default, env var, meaning."""
    hints = typing.get_type_hints(cls)
    rows = ["| Key | Type | Default | Env var | Meaning |", "|---|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            default = repr(f.default)
        else:
            default = "required"
        hint = hints[f.name]
        # a Literal's __name__ is just "Literal": show its choices
        named = typing.get_origin(hint) is not typing.Literal
        type_name = (getattr(hint, "__name__", None) if named else None) or str(hint)
        doc = f.metadata.get("doc", "")
        env = env_var_name(system, f.name)
        cells = (f"`{f.name}`", f"`{type_name.replace('typing.', '')}`", f"`{default}`", f"`{env}`")
        # GitHub tables split cells at every "|", even inside code spans, unless escaped
        row = " | ".join(cell.replace("|", "\\|") for cell in (*cells, doc))
        rows.append(f"| {row} |")
    return "\n".join(rows)
