"""Small JSON helpers: reading objects, deep merging, JSON-Schema defaults."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any


def read_json(path: Path) -> dict[str, Any]:
    """Parse ``path``, which must hold a JSON object."""
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{path} must contain a JSON object")
    return data


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """``override`` on top of ``base``, merging nested dicts."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _snake(name: str) -> str:
    """camelCase -> snake_case (spec.json uses camelCase top-level aliases)."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def schema_defaults(schema: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    """Collect ``default`` values of ``node``'s properties, following $refs."""
    out: dict[str, Any] = {}
    for name, prop in node.get("properties", {}).items():
        if "default" in prop:
            out[_snake(name)] = prop["default"]
            continue
        refs = [prop.get("$ref")] + [a.get("$ref") for a in prop.get("anyOf", [])]
        ref = next((r for r in refs if r), None)
        if ref:
            nested = schema_defaults(schema, schema["$defs"][ref.rsplit("/", 1)[-1]])
            if nested:
                out[_snake(name)] = nested
    return out
