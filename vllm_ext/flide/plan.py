"""Turn user items (texts) into packed passes of token ids, and results back.

Texts are tokenized separately and joined in token space: the context with
the tokenizer's special tokens (BOS), questions and labels without. A
question's result therefore equals the model's output on the token sequence
``context_ids + question_ids`` (+ ``label_ids``), which is what the
exactness tests compare against. Pure Python, no vLLM.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from vllm_ext.flide.batch import FlideInputError
from vllm_ext.flide.config import FlideConfig

Tokenize = Callable[[str, bool], list[int]]
# the pass budget where neither max_packed_tokens nor the engine's step size is known
UNBOUNDED_PASS_TOKENS = 8192


@dataclass(frozen=True)
class Question:
    item: int
    id: str
    ids: tuple[int, ...]


@dataclass(frozen=True)
class Pass:
    """One packed pass: ``items`` as ``[(context_ids, [question_ids])]`` and their questions."""

    items: list
    questions: list[Question]


def parse_items(
    items: Sequence[Mapping], tokenize: Tokenize, config: FlideConfig
) -> tuple[list[tuple[int, ...]], list[Question]]:
    """Validate the request shape and tokenize; question ids default to ``"<item>.<index>"``."""
    if not isinstance(items, Sequence) or not items:
        raise FlideInputError("'items' must be a non-empty list")
    contexts: list[tuple[int, ...]] = []
    questions: list[Question] = []
    seen: set[str] = set()
    for i, item in enumerate(items):
        if not isinstance(item, Mapping) or set(item) - {"context", "questions"}:
            raise FlideInputError(f"item {i} must be an object with 'context' and 'questions'")
        context, asked = item.get("context"), item.get("questions")
        if not isinstance(context, str) or not context:
            raise FlideInputError(f"item {i}: 'context' must be a non-empty string")
        if not isinstance(asked, Sequence) or isinstance(asked, str) or not asked:
            raise FlideInputError(f"item {i}: 'questions' must be a non-empty list")
        contexts.append(tuple(tokenize(context, True)))
        for j, question in enumerate(asked):
            qid, text = _question_fields(question, f"{i}.{j}", f"item {i}, question {j}")
            if qid in seen:
                raise FlideInputError(f"duplicate question id {qid!r}")
            seen.add(qid)
            questions.append(Question(i, qid, tuple(tokenize(text, False))))
    if len(questions) > config.max_questions:
        raise FlideInputError(
            f"{len(questions)} questions exceed max_questions {config.max_questions}"
        )
    return contexts, questions


def _question_fields(question, default_id: str, where: str) -> tuple[str, str]:
    if isinstance(question, str):
        text, qid = question, default_id
    elif isinstance(question, Mapping) and set(question) <= {"id", "text"}:
        text, qid = question.get("text"), question.get("id", default_id)
    else:
        raise FlideInputError(f"{where}: a question is a string or {{'id', 'text'}}")
    if not isinstance(text, str) or not text:
        raise FlideInputError(f"{where}: empty question text")
    if not isinstance(qid, str):
        raise FlideInputError(f"{where}: 'id' must be a string")
    return qid, text


def parse_labels(labels: Sequence[str], tokenize: Tokenize, config: FlideConfig):
    if isinstance(labels, str) or not isinstance(labels, Sequence) or len(labels) < 2:
        raise FlideInputError("'labels' must be a list of at least 2 strings")
    if len(labels) > config.max_labels:
        raise FlideInputError(f"{len(labels)} labels exceed max_labels {config.max_labels}")
    if len(set(labels)) != len(labels) or not all(isinstance(x, str) and x for x in labels):
        raise FlideInputError("labels must be distinct non-empty strings")
    return [tuple(tokenize(label, False)) for label in labels]


def pass_budget(config: FlideConfig, max_num_batched_tokens: int | None) -> int:
    """Tokens per packed pass: ``max_packed_tokens`` (None: vLLM's ``max_num_batched_tokens``),
    capped at ``max_num_batched_tokens``.

    A pass runs between engine steps and holds every other request until it
    ends; capped so, it is no longer than the longest step vLLM itself
    schedules, and a bigger call is split into passes that let the engine
    step in between. Without either bound, :data:`UNBOUNDED_PASS_TOKENS`.
    """
    step = max_num_batched_tokens if max_num_batched_tokens and max_num_batched_tokens > 0 else None
    bounds = [b for b in (config.max_packed_tokens, step) if b is not None]
    return min(bounds) if bounds else UNBOUNDED_PASS_TOKENS


def engine_step_tokens(vllm_config) -> int | None:
    """``max_num_batched_tokens`` of a vLLM config (``None`` where it has none)."""
    scheduler = getattr(vllm_config, "scheduler_config", None)
    return getattr(scheduler, "max_num_batched_tokens", None)


def plan_passes(contexts, questions: Sequence[Question], label_ids, budget: int) -> list[Pass]:
    """Group questions into passes of at most ``budget`` packed tokens.

    A context is packed once per pass it appears in; a context with more
    questions than fit is split across passes (repeating the context). One
    context + one question always forms a pass, even above the budget.
    """
    extra = sum(len(label) - 1 for label in label_ids)
    passes: list[Pass] = []
    current: dict[int, list[Question]] = {}
    used = 0
    for question in questions:
        cost = len(question.ids) + extra
        cost_new = cost + (0 if question.item in current else len(contexts[question.item]))
        if current and used + cost_new > budget:
            passes.append(_make_pass(contexts, current))
            current, used = {}, 0
            cost_new = cost + len(contexts[question.item])
        current.setdefault(question.item, []).append(question)
        used += cost_new
    if current:
        passes.append(_make_pass(contexts, current))
    return passes


def _make_pass(contexts, grouped: dict[int, list[Question]]) -> Pass:
    items = [[list(contexts[i]), [list(q.ids) for q in qs]] for i, qs in grouped.items()]
    return Pass(items, [q for qs in grouped.values() for q in qs])
