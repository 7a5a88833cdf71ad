"""From classification items to a packed batch, and from its logits to classes.

An item is one shared context with its questions (token ids, already
tokenized). Every question is scored against the same label set:

- a one-token label is read from the logits at the question's last token;
- a label of ``m > 1`` tokens is teacher-forced: its first ``m - 1`` tokens are
  packed as a child segment of the question, and its score is the sum of the
  log-probabilities of all ``m`` tokens, each given the context, the question
  and the label tokens before it — exactly what a separate pass over
  ``context + question + label`` would give.

Class probabilities are the label sequence likelihoods renormalised over the
label set (``softmax`` of the summed log-probabilities); for one-token labels
that is the softmax of the label logits. Pure torch, no vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vllm_ext.flide.packing import PackedLayout, pack_segments


class FlideInputError(ValueError):
    """A classification request is malformed; the message names the offending part."""


@dataclass(frozen=True)
class Item:
    """One shared context and the questions asked about it (token ids)."""

    context: tuple[int, ...]
    questions: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class PackedBatch:
    """A packed sequence plus where each (question, label) score is read.

    Attributes:
        layout: the packed sequence.
        readout_rows: ``[R]`` token indices whose logits are needed.
        score_row: ``[Q, L, M]`` index into ``readout_rows`` for label token ``m``
            of label ``l`` of question ``q`` (``-1`` past the label's end).
        score_token: ``[Q, L, M]`` the label token id read there (0 where unused).
        question_item: ``[Q]`` item index of every question, in input order.
    """

    layout: PackedLayout
    readout_rows: torch.Tensor
    score_row: torch.Tensor
    score_token: torch.Tensor
    question_item: torch.Tensor


def validate_labels(
    labels: Sequence[Sequence[int]], vocab_size: int
) -> tuple[tuple[int, ...], ...]:
    """Labels as token-id tuples; empty, duplicate or out-of-vocabulary labels raise."""
    if len(labels) < 2:
        raise FlideInputError(f"need at least 2 labels, got {len(labels)}")
    out = tuple(tuple(int(t) for t in label) for label in labels)
    for i, label in enumerate(out):
        if not label:
            raise FlideInputError(f"label {i} tokenizes to no tokens")
        bad = [t for t in label if not 0 <= t < vocab_size]
        if bad:
            raise FlideInputError(f"label {i} has token ids {bad} outside the vocabulary")
    if len(set(out)) != len(out):
        raise FlideInputError("two labels tokenize to the same token ids")
    return out


def validate_items(
    items: Sequence[Item], labels: Sequence[Sequence[int]], max_model_len: int
) -> None:
    """Reject empty items and any lineage (context + question + label) beyond ``max_model_len``."""
    if not items:
        raise FlideInputError("no items to classify")
    longest_label = max(len(label) for label in labels)
    for i, item in enumerate(items):
        if not item.context:
            raise FlideInputError(f"item {i}: empty context")
        if not item.questions:
            raise FlideInputError(f"item {i}: empty question list")
        for j, question in enumerate(item.questions):
            if not question:
                raise FlideInputError(f"item {i}, question {j}: empty question")
            # the last label token is predicted, never fed: it needs no position
            total = len(item.context) + len(question) + longest_label - 1
            if total > max_model_len:
                raise FlideInputError(
                    f"item {i}, question {j}: context ({len(item.context)}) + question "
                    f"({len(question)}) + label tokens ({longest_label - 1}) = {total} "
                    f"exceeds max_model_len {max_model_len}"
                )


def pack_items(
    items: Sequence[Item], labels: Sequence[Sequence[int]], isolate: bool = True
) -> PackedBatch:
    """Build the packed sequence for ``items`` scored against ``labels`` (validated).

    ``isolate=False`` is naive packing, kept as a benchmark baseline: each
    question continues from the previous one (one causal sequence), so later
    questions see, and are disturbed by, earlier ones.
    """
    segments: list[Sequence[int]] = []
    parents: list[int] = []
    # per question: its segment, and per label the segment of its continuation
    question_seg: list[int] = []
    label_seg: list[list[int]] = []
    question_item: list[int] = []
    for i, item in enumerate(items):
        ctx = len(segments)
        segments.append(item.context)
        parents.append(-1)
        previous = ctx
        for question in item.questions:
            q = len(segments)
            segments.append(question)
            parents.append(ctx if isolate else previous)
            previous = q
            question_seg.append(q)
            question_item.append(i)
            conts = []
            for label in labels:
                if len(label) > 1:
                    conts.append(len(segments))
                    segments.append(label[:-1])
                    parents.append(q)
                else:
                    conts.append(-1)
            label_seg.append(conts)
    layout = pack_segments(segments, parents)
    rows, score_row, score_token = _readouts(layout, labels, question_seg, label_seg)
    return PackedBatch(layout, rows, score_row, score_token, torch.tensor(question_item))


def _readouts(layout, labels, question_seg, label_seg):
    """Token rows to read and, per (question, label, label token), which row and token id."""
    width = max(len(label) for label in labels)
    score_row = torch.full((len(question_seg), len(labels), width), -1, dtype=torch.long)
    score_token = torch.zeros_like(score_row)
    rows: list[int] = []
    for q, seg in enumerate(question_seg):
        last = int(layout.ends[seg]) - 1
        for lab, label in enumerate(labels):
            # token m of the label is predicted at the token before it in the lineage
            feed = [last]
            if label_seg[q][lab] >= 0:
                cont = label_seg[q][lab]
                feed += range(int(layout.starts[cont]), int(layout.ends[cont]))
            for m, row in enumerate(feed):
                score_row[q, lab, m] = len(rows)
                score_token[q, lab, m] = label[m]
                rows.append(row)
    # the same row (a question's last token) serves every label: read it once
    unique, inverse = torch.unique(torch.tensor(rows, dtype=torch.long), return_inverse=True)
    mapped = torch.where(score_row >= 0, inverse[score_row.clamp(min=0)], -1)
    return unique, mapped, score_token


def label_logprobs(batch: PackedBatch, row_logprobs: torch.Tensor) -> torch.Tensor:
    """``[Q, L]`` summed log-probability of every label for every question.

    Args:
        row_logprobs: ``[R, V]`` log-softmax of the logits at ``batch.readout_rows``.
    """
    used = batch.score_row >= 0
    picked = row_logprobs.float()[batch.score_row.clamp(min=0), batch.score_token]
    return torch.where(used, picked, 0.0).sum(-1)


def classes_and_probs(logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Argmax label and probabilities renormalised over the label set, from ``[Q, L]``."""
    return logp.argmax(-1), torch.softmax(logp, dim=-1)
