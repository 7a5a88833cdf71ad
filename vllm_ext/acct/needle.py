"""Needle retrieval over an imported cache: exact match of greedy answers (no vLLM).

A held-out ShareGPT conversation is the haystack. One sentence, "The secret
code of NAME is DDDD.", is spliced into its tokens at a random depth; that is
the context the cache holds. The question is then computed by the target
itself over the cache (as the connector leaves the last prompt tokens to vLLM)
and ends in the answer's own prefix ("... The secret code of NAME is"), a
format SmolLM2-135M solves over its own prefill. The greedy answer is an exact
match when its leading digits are the code.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import torch

from vllm_ext.acct.data import long_conversations
from vllm_ext.acct.llama import KV, TorchLlama, concat_kv

NAMES = ("Alice", "Bruno", "Chen", "Dmitri", "Elena", "Farah", "Goran", "Hiro", "Ines", "Jonas",
         "Kofi", "Lena", "Marta", "Nikhil", "Olga", "Pavel")  # fmt: skip
_DIGITS = re.compile(r"\s*(\d+)")


@dataclass(frozen=True)
class Needle:
    conversation_id: str
    context: np.ndarray  # haystack with the needle spliced in
    question: np.ndarray  # computed by the target over the cache
    code: str
    depth: int  # token index of the needle's first token in ``context``


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def needle_set(tokenizer, context: int, count: int, seed: int = 0) -> list[Needle]:
    """``count`` needles in the first tokens of ``count`` held-out conversations."""
    rng = np.random.default_rng(seed)
    items = []
    for cid, ids in long_conversations(tokenizer, context, "eval", count):
        name = NAMES[int(rng.integers(len(NAMES)))]
        code = str(int(rng.integers(1000, 10000)))
        needle = _ids(tokenizer, f"\nThe secret code of {name} is {code}.\n")
        hay = ids[: context - len(needle)]
        depth = int(rng.uniform(0.1, 0.9) * len(hay))
        question = _ids(
            tokenizer,
            f"<|im_end|>\n<|im_start|>user\nWhat is the secret code of {name}?<|im_end|>\n"
            f"<|im_start|>assistant\nThe secret code of {name} is",
        )
        full = hay[:depth] + needle + hay[depth:]
        items.append(Needle(cid, np.array(full), np.array(question), code, depth))
    return items


@torch.no_grad()
def greedy_answer(
    target: TorchLlama, cache: list[KV] | None, question: torch.Tensor, start: int, max_new: int
) -> list[int]:
    """Greedy tokens after ``question`` placed at ``start`` over ``cache`` (None: no context)."""
    ids, out = question, []
    for _ in range(max_new):
        positions = torch.arange(start, start + ids.shape[0])
        logits, new = target.forward_with_cache(ids, positions, cache)
        cache = new if cache is None else [concat_kv(c, n) for c, n in zip(cache, new, strict=True)]
        start += ids.shape[0]
        ids = logits[-1:].argmax(-1)
        out.append(int(ids))
    return out


def exact_match(text: str, code: str) -> bool:
    found = _DIGITS.match(text)
    return found is not None and found.group(1) == code


@torch.no_grad()
def score_needles(
    target: TorchLlama, pipelines: dict, items: list[Needle], keep: dict[str, int],
    max_new: int = 6, progress=None,
) -> list[dict]:  # fmt: skip
    """Per needle, each variant's greedy answer and exact match: ``own``, ``acct:<name>``
    (``pipelines``), ``truncated:<N>`` (the last ``keep[name]`` context tokens), ``no_context``."""
    from vllm_ext.acct.pipeline import own_prefill

    rows = []
    for i, item in enumerate(items):
        context = torch.as_tensor(item.context, dtype=torch.long)
        question = torch.as_tensor(item.question, dtype=torch.long)
        n = context.shape[0]
        caches = {"own": (own_prefill(target, context), n)}
        for name, pipeline in pipelines.items():
            caches[f"acct:{name}"] = (pipeline.build_cache(context), n)
            tokens = keep[name]
            caches.setdefault(
                f"truncated:{tokens}", (own_prefill(target, context[-tokens:]), tokens)
            )
        caches["no_context"] = (None, 0)
        answers = {
            name: greedy_answer(target, cache, question, start, max_new)
            for name, (cache, start) in caches.items()
        }
        rows.append({"conversation_id": item.conversation_id, "code": item.code,
                     "depth": item.depth, "context": n, "answers": answers})  # fmt: skip
        if progress is not None:
            progress(i, rows[-1])
    return rows
