"""``PackedClassifier``: the Python interface of Flide.

    clf = PackedClassifier(llm, labels=[" yes", " no"])
    clf.classify([{"context": doc, "questions": ["Is it about X?", ...]}])

``llm`` is a ``vllm.LLM`` started with
``worker_extension_cls="vllm_ext.flide.worker.FlideWorkerExtension"`` (or a
model path: the classifier then starts one). The same engine keeps serving
``generate``; each packed pass runs between its steps, and no pass is longer
than ``max_packed_tokens`` or the engine's ``max_num_batched_tokens`` (a
bigger call is split into several passes).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from vllm_ext.flide.config import FlideConfig
from vllm_ext.flide.plan import (
    Question,
    engine_step_tokens,
    parse_items,
    parse_labels,
    pass_budget,
    plan_passes,
)

WORKER_EXTENSION = "vllm_ext.flide.worker.FlideWorkerExtension"
RPC_METHOD = "flide_classify"


@dataclass(frozen=True)
class Answer:
    """One question's class, probabilities over the labels and summed label log-probs."""

    id: str
    label: str
    probs: dict[str, float]
    logprobs: dict[str, float]

    def as_dict(self) -> dict:
        return {"id": self.id, "label": self.label, "probs": self.probs, "logprobs": self.logprobs}


def answers(questions: Sequence[Question], logp: Sequence[Sequence[float]], labels) -> list[Answer]:
    """Per question: argmax label and the label likelihoods renormalised over the label set."""
    out = []
    for question, row in zip(questions, logp, strict=True):
        top = max(row)
        weights = [math.exp(x - top) for x in row]
        total = sum(weights)
        best = max(range(len(row)), key=row.__getitem__)
        out.append(
            Answer(
                question.id,
                labels[best],
                {lab: w / total for lab, w in zip(labels, weights, strict=True)},
                dict(zip(labels, row, strict=True)),
            )
        )
    return out


class PackedClassifier:
    """Classify many questions per shared context in packed passes on a vLLM engine."""

    def __init__(self, llm, labels: Sequence[str], config: FlideConfig | None = None, **llm_kwargs):
        if isinstance(llm, str):
            from vllm import LLM

            llm = LLM(model=llm, worker_extension_cls=WORKER_EXTENSION, **llm_kwargs)
        self.llm = llm
        self.config = config or FlideConfig()
        self.tokenizer = llm.get_tokenizer()
        self.labels = list(labels)
        self.label_ids = parse_labels(self.labels, self._tokenize, self.config)
        step = engine_step_tokens(getattr(getattr(llm, "llm_engine", None), "vllm_config", None))
        self.budget = pass_budget(self.config, step)

    def _tokenize(self, text: str, special: bool) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=special)

    def classify(self, items: Sequence[Mapping]) -> list[Answer]:
        """One :class:`Answer` per question, in input order."""
        contexts, questions = parse_items(items, self._tokenize, self.config)
        results: list[Answer] = []
        for packed in plan_passes(contexts, questions, self.label_ids, self.budget):
            payload = {"items": packed.items, "labels": [list(x) for x in self.label_ids]}
            logp = self.llm.collective_rpc(RPC_METHOD, args=(payload,))[0]
            results += answers(packed.questions, logp, self.labels)
        order = {q.id: n for n, q in enumerate(questions)}
        return sorted(results, key=lambda a: order[a.id])
