"""Flide request parsing, validation and pass planning: bad input raises a named error."""

from __future__ import annotations

import pytest

from vllm_ext.common.config import ConfigError
from vllm_ext.flide.batch import FlideInputError, Item, validate_items, validate_labels
from vllm_ext.flide.classifier import answers
from vllm_ext.flide.config import FlideConfig, flide_config
from vllm_ext.flide.plan import (
    UNBOUNDED_PASS_TOKENS,
    engine_step_tokens,
    parse_items,
    parse_labels,
    pass_budget,
    plan_passes,
)


def tokenize(text: str, special: bool) -> list[int]:
    return ([0] if special else []) + [ord(c) for c in text]


CONFIG = FlideConfig()


@pytest.mark.parametrize(
    "items, message",
    [
        ([], "non-empty list"),
        ([{"context": "c", "questions": []}], "non-empty list"),
        ([{"context": "", "questions": ["q"]}], "context"),
        ([{"context": "c", "questions": [""]}], "empty question"),
        ([{"context": "c", "questions": ["a"], "extra": 1}], "must be an object"),
        ([{"context": "c", "questions": [{"id": "x", "text": "a"}, {"id": "x", "text": "b"}]}],
         "duplicate question id 'x'"),
    ],
)  # fmt: skip
def test_bad_items_raise_named_errors(items, message):
    with pytest.raises(FlideInputError, match=message):
        parse_items(items, tokenize, CONFIG)


def test_too_many_questions_and_labels():
    items = [{"context": "c", "questions": ["a", "b", "c"]}]
    with pytest.raises(FlideInputError, match="max_questions 2"):
        parse_items(items, tokenize, FlideConfig(max_questions=2))
    with pytest.raises(FlideInputError, match="max_labels 2"):
        parse_labels(["a", "b", "c"], tokenize, FlideConfig(max_labels=2))
    with pytest.raises(FlideInputError, match="distinct"):
        parse_labels(["a", "a"], tokenize, CONFIG)


def test_labels_outside_the_vocabulary_and_too_long_lineages():
    with pytest.raises(FlideInputError, match="outside the vocabulary"):
        validate_labels([(1,), (99,)], vocab_size=50)
    with pytest.raises(FlideInputError, match="same token ids"):
        validate_labels([(1,), (1,)], vocab_size=50)
    item = Item(tuple(range(10)), ((1, 2, 3),))
    with pytest.raises(FlideInputError, match="exceeds max_model_len 12"):
        validate_items([item], [(1,), (2, 3)], max_model_len=12)
    validate_items([item], [(1,), (2, 3)], max_model_len=14)


def test_passes_respect_the_budget_and_keep_order():
    contexts, questions = parse_items(
        [{"context": "x" * 9, "questions": ["aa", "bb", "cc"]},
         {"context": "y", "questions": ["d"]}],
        tokenize, CONFIG,
    )  # fmt: skip
    labels = parse_labels(["p", "qq"], tokenize, CONFIG)  # one continuation token per question
    passes = plan_passes(contexts, questions, labels, budget=18)
    # context 10 tokens + 3 per question: two questions fit, the third opens a pass
    assert [[q.id for q in p.questions] for p in passes] == [["0.0", "0.1"], ["0.2", "1.0"]]
    assert [len(p.items) for p in passes] == [1, 2]
    assert [q.id for p in passes for q in p.questions] == [q.id for q in questions]


def test_a_pass_is_capped_at_the_engines_step_tokens():
    from types import SimpleNamespace

    vllm_config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_batched_tokens=2048))
    assert engine_step_tokens(vllm_config) == 2048
    assert engine_step_tokens(None) is None
    assert pass_budget(FlideConfig(max_packed_tokens=8192), 2048) == 2048
    assert pass_budget(FlideConfig(max_packed_tokens=512), 2048) == 512
    assert pass_budget(FlideConfig(max_packed_tokens=512), None) == 512
    assert FlideConfig().max_packed_tokens is None  # default: the engine's step size
    assert pass_budget(FlideConfig(), 2048) == 2048
    assert pass_budget(FlideConfig(), None) == UNBOUNDED_PASS_TOKENS
    contexts, questions = parse_items(
        [{"context": "x" * 99, "questions": ["q" * 30] * 20}], tokenize, CONFIG
    )
    passes = plan_passes(contexts, questions, [(1,), (2,)], pass_budget(CONFIG, 256))
    sizes = [sum(len(c) + sum(len(q) for q in qs) for c, qs in p.items) for p in passes]
    assert max(sizes) <= 256 and len(passes) == 4


def test_answers_renormalise_over_labels():
    _, questions = parse_items([{"context": "c", "questions": ["a"]}], tokenize, CONFIG)
    (answer,) = answers(questions, [[-1.0, -2.0]], ["yes", "no"])
    assert answer.label == "yes"
    assert answer.probs["yes"] == pytest.approx(1 / (1 + 2.718281828**-1))


def test_config_rejects_unknown_keys_and_bad_values():
    with pytest.raises(ConfigError, match="unknown key 'max_tokens'"):
        flide_config({"max_tokens": 3})
    with pytest.raises(ConfigError, match="max_labels must be >= 2"):
        flide_config({"max_labels": 1})
    assert flide_config({}, environ={"VLLMEXT_FLIDE_MAX_QUESTIONS": "7"}).max_questions == 7
    with pytest.raises(ConfigError, match="max_packed_tokens must be >= 1"):
        flide_config({"max_packed_tokens": 0})
    env = {"VLLMEXT_FLIDE_MAX_PACKED_TOKENS": "1024"}
    assert flide_config({}, environ=env).max_packed_tokens == 1024
    assert flide_config({"max_packed_tokens": None}).max_packed_tokens is None
