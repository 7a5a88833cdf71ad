"""``python -m vllm_ext.flide``: classify a JSONL file of items in packed passes.

Each input line is one item, ``{"context": "...", "questions": ["...", {"id", "text"}]}``;
each output line is ``{"line": n, "results": [{"id", "label", "probs", "logprobs"}]}``
for that item, or ``{"line": n, "error": "..."}`` when the line is malformed
(the other lines are still classified; the exit status is then 1). Items are
sent ``--items-per-call`` at a time so that passes stay full. The engine is an
in-process vLLM ``LLM`` with Flide's worker extension; engine arguments
(``--dtype``, ``--max-model-len``, ...) pass through as ``--engine-arg KEY=VALUE``.

    python -m vllm_ext.flide MODEL --input items.jsonl --labels " yes" " no" --output out.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path

from tqdm import tqdm

from vllm_ext.flide.batch import FlideInputError
from vllm_ext.flide.config import flide_config


def read_items(path: Path) -> Iterator[tuple[int, dict | None, str | None]]:
    """``(line number, item, error)`` per non-empty line; a bad line is an error, not a stop."""
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                yield number, None, f"line {number} is not valid JSON: {exc.msg}"
                continue
            if not isinstance(item, dict):
                yield number, None, f"line {number} must be a JSON object"
                continue
            yield number, item, None


def classify_lines(classifier, lines, items_per_call: int) -> Iterator[dict]:
    """Records in input order; a rejected call is retried item by item to name the culprit."""
    batch: list[tuple[int, dict]] = []

    def flush() -> Iterator[dict]:
        try:
            yield from _records(classifier, batch)
        except FlideInputError:
            for number, item in batch:
                try:
                    yield from _records(classifier, [(number, item)])
                except FlideInputError as exc:
                    yield {"line": number, "error": str(exc)}
        batch.clear()

    for number, item, error in lines:
        if error is not None:
            yield from flush()
            yield {"line": number, "error": error}
            continue
        batch.append((number, item))
        if len(batch) >= items_per_call:
            yield from flush()
    yield from flush()


def _records(classifier, batch: list[tuple[int, dict]]) -> Iterator[dict]:
    if not batch:
        return
    # ids are made unique across the call; each question's own id (or its index) comes back
    tagged = [_tag_questions(number, item) for number, item in batch]
    answers = {a.id: a.as_dict() for a in classifier.classify([item for item, _ in tagged])}
    for (number, _), (item, own_ids) in zip(batch, tagged, strict=True):
        results = [answers[q["id"]] | {"id": own} for q, own in zip(item["questions"], own_ids,
                                                                    strict=True)]  # fmt: skip
        yield {"line": number, "results": results}


def _tag_questions(number: int, item: dict) -> tuple[dict, list[str]]:
    """The item with call-unique question ids, and the ids to report (the user's, or indices)."""
    questions = item.get("questions")
    if not isinstance(questions, list):
        return item, []  # the classifier names the problem
    tagged, own_ids = [], []
    for j, question in enumerate(questions):
        own = str(question.get("id", j)) if isinstance(question, dict) else str(j)
        if own in own_ids:
            raise FlideInputError(f"line {number}: duplicate question id {own!r}")
        own_ids.append(own)
        text = question.get("text") if isinstance(question, dict) else question
        tagged.append({"id": f"{number}:{j}", "text": text})
    return {**item, "questions": tagged}, own_ids


def parse_engine_args(pairs: list[str]) -> dict:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--engine-arg wants KEY=VALUE, got {pair!r}")
        try:
            out[key.replace("-", "_")] = json.loads(value)
        except json.JSONDecodeError:
            out[key.replace("-", "_")] = value
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vllm_ext.flide", description=__doc__)
    parser.add_argument("model")
    parser.add_argument("--input", type=Path, required=True, help="JSONL, one item per line")
    parser.add_argument("--output", type=Path, help="JSONL results (default: stdout)")
    parser.add_argument("--labels", nargs="+", required=True, help='e.g. " yes" " no"')
    parser.add_argument("--items-per-call", type=int, default=16)
    parser.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    if args.items_per_call < 1:
        parser.error("--items-per-call must be >= 1")
    if not args.input.is_file():
        parser.error(f"--input {args.input} is not a file")
    engine_args = parse_engine_args(args.engine_arg)
    config = flide_config()

    from vllm_ext.flide.classifier import PackedClassifier

    classifier = PackedClassifier(args.model, args.labels, config, **engine_args)
    with args.input.open(encoding="utf-8") as f:
        total = sum(1 for line in f if line.strip())
    out = args.output.open("w", encoding="utf-8") if args.output else sys.stdout
    errors = 0
    try:
        lines = tqdm(read_items(args.input), total=total, desc="flide items", file=sys.stderr)
        for record in classify_lines(classifier, lines, args.items_per_call):
            errors += "error" in record
            out.write(json.dumps(record) + "\n")
    finally:
        if out is not sys.stdout:
            out.close()
    return 1 if errors else 0
