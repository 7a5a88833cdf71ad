"""The Flide benchmark's workloads: (context ids, [question ids]) per point.

- ``bfcl``: a BFCL task's tool schemas (the JSON a server puts before every
  request) as context; BFCL user turns as questions ("does this request need
  a tool call?");
- ``fewshot``: a few-shot header of ShareGPT messages labelled "asks for
  code: yes/no" as context; other ShareGPT messages as questions;
- ``sharegpt``: one long ShareGPT conversation as context; short questions
  about it.

Contexts are truncated (or grown) to the requested token count; questions are
capped at ~60 tokens, so every variant computes the same token sequences.
"""

from __future__ import annotations

from vllm_ext.datasets.bfcl import load_multi_turn, shared_prefix
from vllm_ext.datasets.sharegpt import first_turns, iter_conversations

WORKLOADS = ("bfcl", "fewshot", "sharegpt")
QUESTION_CHARS = 200


def build(name: str, num_questions: int, context_tokens: int, tokenizer):
    """``(context ids, [question ids])`` for workload ``name``."""
    context, questions = {"bfcl": _bfcl, "fewshot": _fewshot, "sharegpt": _sharegpt}[name](
        num_questions
    )
    ids = tokenizer.encode(context)[:context_tokens]
    return ids, [tokenizer.encode(q, add_special_tokens=False) for q in questions]


def _bfcl(num_questions: int):
    tasks = load_multi_turn("base")
    turns = [m["content"] for t in tasks for turn in t.turns for m in turn if m["role"] == "user"]
    questions = [
        f"\nRequest: {turns[n % len(turns)][:QUESTION_CHARS]}\n"
        "Does this request need a tool call? Answer:"
        for n in range(num_questions)
    ]
    return shared_prefix(tasks[0]), questions


def _fewshot(num_questions: int):
    samples = first_turns(64 + num_questions, seed=3, max_prompt_chars=600)
    header = ["Decide whether each message asks for program code.\n"]
    for s in samples[:64]:
        asks = "yes" if any(w in s.prompt.lower() for w in ("code", "python", "function")) else "no"
        header.append(f"\nMessage: {_one_line(s.prompt)}\nAsks for code: {asks}\n")
    questions = [f"\nMessage: {_one_line(s.prompt)}\nAsks for code:" for s in samples[64:]]
    return "".join(header), questions


def _sharegpt(num_questions: int):
    conversation = max(
        (c for c in iter_conversations(400) if len(c["conversations"]) >= 4),
        key=lambda c: sum(len(t.get("value", "")) for t in c["conversations"]),
    )
    context = "".join(
        f"\n{t.get('from', '')}: {t.get('value', '')}" for t in conversation["conversations"]
    )
    topics = first_turns(num_questions, seed=5, max_prompt_chars=600)
    questions = [
        f"\nQuestion: is the conversation above about this: {_one_line(s.prompt)}? Answer:"
        for s in topics
    ]
    return context, questions


def _one_line(text: str) -> str:
    return " ".join(text.split())[:QUESTION_CHARS]
