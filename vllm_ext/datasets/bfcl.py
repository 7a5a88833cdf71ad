"""BFCL v4 multi-turn function-calling tasks from the ``bfcl-eval`` package.

Tasks live in ``bfcl_eval/data/BFCL_v4_multi_turn_<category>.json`` (JSON
lines) and the tool schemas of the API classes they involve in
``bfcl_eval/data/multi_turn_func_doc/*.json``. The class -> schema-file mapping
is read from bfcl's own constants module by parsing it (not importing it, since
importing ``bfcl_eval`` pulls in heavy dependencies).
"""

from __future__ import annotations

import ast
import functools
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_ext.datasets._paths import data_path

logger = logging.getLogger(__name__)

MULTI_TURN_CATEGORIES: tuple[str, ...] = ("base", "long_context", "miss_func", "miss_param")
_MAPPING_MODULE = ("constants", "executable_backend_config.py")
_MAPPING_NAME = "MULTI_TURN_FUNC_DOC_FILE_MAPPING"


@dataclass(frozen=True)
class BfclTask:
    """One multi-turn BFCL task.

    ``turns[i]`` is the list of user messages (``{"role", "content"}``) of turn
    ``i`` (it may be empty in ``miss_func``, where that turn only reveals a
    held-out function). ``missed_functions`` maps a turn index to the names of
    functions whose schemas are withheld until that turn.
    """

    id: str
    turns: list[list[dict[str, Any]]]
    involved_classes: tuple[str, ...]
    initial_config: dict[str, Any]
    category: str = "base"
    missed_functions: dict[int, tuple[str, ...]] = field(default_factory=dict)
    excluded_functions: tuple[str, ...] = ()


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    with path.open(encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _task_from_record(record: dict[str, Any], category: str) -> BfclTask:
    missed = {
        int(turn): tuple(names) for turn, names in (record.get("missed_function") or {}).items()
    }
    return BfclTask(
        id=record["id"],
        turns=[list(turn) for turn in record["question"]],
        involved_classes=tuple(record["involved_classes"]),
        initial_config=record.get("initial_config") or {},
        category=category,
        missed_functions=missed,
        excluded_functions=tuple(record.get("excluded_function") or ()),
    )


def load_multi_turn(category: str = "base") -> list[BfclTask]:
    """Load the multi-turn tasks of ``category`` (one of MULTI_TURN_CATEGORIES).

    The files are small (tens of ms to parse), so each call returns freshly
    parsed tasks that the caller may mutate.
    """
    if category not in MULTI_TURN_CATEGORIES:
        raise ValueError(
            f"unknown BFCL multi-turn category {category!r}; "
            f"expected one of {MULTI_TURN_CATEGORIES}"
        )
    path = data_path("bfcl_eval", "data", f"BFCL_v4_multi_turn_{category}.json")
    tasks = [_task_from_record(r, category) for r in _read_jsonl(path)]
    logger.debug("BFCL multi_turn_%s: %d tasks", category, len(tasks))
    return tasks


def schema_files() -> dict[str, str]:
    """API class name -> schema file name, as declared by bfcl-eval."""
    return dict(_schema_files())


@functools.lru_cache(maxsize=1)
def _schema_files() -> dict[str, str]:
    source = data_path("bfcl_eval", *_MAPPING_MODULE).read_text(encoding="utf-8")
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == _MAPPING_NAME for t in node.targets
        ):
            return dict(ast.literal_eval(node.value))
    raise LookupError(f"{_MAPPING_NAME} not found in bfcl_eval/{'/'.join(_MAPPING_MODULE)}")


@functools.cache
def _class_schemas(class_name: str) -> tuple[dict[str, Any], ...]:
    mapping = _schema_files()
    if class_name not in mapping:
        raise KeyError(f"unknown BFCL API class {class_name!r}; known: {sorted(mapping)}")
    path = data_path("bfcl_eval", "data", "multi_turn_func_doc", mapping[class_name])
    return tuple(_read_jsonl(path))


def tool_schemas(class_names: Sequence[str]) -> list[dict[str, Any]]:
    """Function docs of the given API classes, in the given class order.

    Returns fresh copies, so callers may modify them.
    """
    return [json.loads(json.dumps(doc)) for name in class_names for doc in _class_schemas(name)]


def initial_tools(task: BfclTask) -> list[dict[str, Any]]:
    """Tool schemas offered at the start of ``task`` (held-out functions removed)."""
    missed = {name for names in task.missed_functions.values() for name in names}
    return [doc for doc in tool_schemas(task.involved_classes) if doc["name"] not in missed]


def shared_prefix(task: BfclTask) -> str:
    """The tool-schema text a server puts in front of every question of ``task``.

    A deterministic compact JSON dump (sorted keys) of :func:`initial_tools`;
    tasks that involve the same classes share the identical string.
    """
    return json.dumps(
        initial_tools(task), sort_keys=True, ensure_ascii=False, separators=(",", ":")
    )
