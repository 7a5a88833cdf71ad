"""Pack shared contexts, their questions and label continuations into one token sequence.

A packed batch is a forest of *segments*: a context is a root, each question
is a child of its context, and each multi-token label is a child of its
question. Segments are laid out parent-first, so every token's ancestors come
earlier in the sequence. The index tensors built here are all a model needs
to compute every leaf exactly as if its lineage had been computed alone:

- ``positions``: a segment continues numbering from the end of its parent;
- attention: a token sees token ``j`` iff ``j <= i`` and ``j``'s segment is an
  ancestor of (or equal to) its own (:func:`attention_mask`);
- recurrent layers: segment ``s`` starts from the final state of its parent
  (``parent``, processed depth by depth, ``depth``); a causal convolution of
  width ``w`` reads the ``w - 1`` previous tokens of the *lineage*
  (:func:`lineage_window`), which crosses from a question into its context.

Pure torch; runs on any device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PackedLayout:
    """Index tensors of one packed sequence of ``T`` tokens in ``S`` segments.

    Attributes:
        input_ids: ``[T]`` token ids.
        positions: ``[T]`` position ids (lineage offsets).
        segment_of: ``[T]`` segment index of every token.
        starts: ``[S]`` first token of each segment; ``ends`` one past its last.
        parent: ``[S]`` parent segment, ``-1`` for a root.
        depth: ``[S]`` 0 for roots.
        root: ``[S]`` the root segment of each segment's lineage.
        visible: ``[S, S]`` bool, ``visible[a, b]``: ``b`` is ``a`` or an ancestor of ``a``.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    segment_of: torch.Tensor
    starts: torch.Tensor
    ends: torch.Tensor
    parent: torch.Tensor
    depth: torch.Tensor
    root: torch.Tensor
    visible: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def num_segments(self) -> int:
        return int(self.starts.numel())

    def to(self, device: torch.device | str) -> PackedLayout:
        return PackedLayout(**{k: v.to(device) for k, v in self.__dict__.items()})

    def segments_at_depth(self, depth: int) -> torch.Tensor:
        """Indices of the segments at ``depth``, in sequence order."""
        return torch.nonzero(self.depth == depth).flatten()


def pack_segments(tokens: Sequence[Sequence[int]], parents: Sequence[int]) -> PackedLayout:
    """Lay out segments parent-first and build their index tensors.

    Args:
        tokens: token ids of each segment; none may be empty.
        parents: parent index of each segment (``-1`` = root); a parent must
            come before its children.

    Returns:
        The :class:`PackedLayout`; segment ``s`` occupies tokens ``starts[s]:ends[s]``.
    """
    if len(tokens) != len(parents):
        raise ValueError(f"{len(tokens)} segments but {len(parents)} parents")
    lengths = [len(t) for t in tokens]
    if any(n == 0 for n in lengths):
        raise ValueError(f"segment {lengths.index(0)} is empty")
    depth: list[int] = []
    root: list[int] = []
    offset: list[int] = []  # lineage tokens before the segment (its first position)
    for s, p in enumerate(parents):
        if not -1 <= p < s:
            raise ValueError(f"segment {s} has parent {p}: parents must precede children")
        depth.append(0 if p < 0 else depth[p] + 1)
        root.append(s if p < 0 else root[p])
        offset.append(0 if p < 0 else offset[p] + lengths[p])
    ends = torch.tensor(lengths, dtype=torch.long).cumsum(0)
    starts = ends - torch.tensor(lengths, dtype=torch.long)
    segment_of = torch.repeat_interleave(torch.arange(len(tokens)), torch.tensor(lengths))
    within = torch.arange(int(ends[-1])) - starts[segment_of]
    positions = torch.tensor(offset, dtype=torch.long)[segment_of] + within
    parent = torch.tensor(list(parents), dtype=torch.long)
    return PackedLayout(
        input_ids=torch.tensor([t for seg in tokens for t in seg], dtype=torch.long),
        positions=positions,
        segment_of=segment_of,
        starts=starts,
        ends=ends,
        parent=parent,
        depth=torch.tensor(depth, dtype=torch.long),
        root=torch.tensor(root, dtype=torch.long),
        visible=_ancestry(parent),
    )


def _ancestry(parent: torch.Tensor) -> torch.Tensor:
    """``[S, S]`` bool: row ``a`` marks ``a`` and all its ancestors."""
    num = parent.numel()
    visible = torch.eye(num, dtype=torch.bool)
    for a in range(num):
        p = int(parent[a])
        if p >= 0:
            # parents come first, so the parent's row is already complete
            visible[a] |= visible[p]
    return visible


def key_start(layout: PackedLayout) -> torch.Tensor:
    """``[T]`` first token any row may attend to: the start of its root segment."""
    return layout.starts[layout.root[layout.segment_of]]


def attention_mask(layout: PackedLayout, rows: slice | None = None) -> torch.Tensor:
    """Boolean mask ``[R, T]`` (True = attend) for query rows ``rows`` (default all).

    Token ``i`` sees ``j`` iff ``j <= i`` and segment(j) is segment(i) or one of
    its ancestors; with parents laid out first this is causal ∧ same lineage.
    """
    rows = rows or slice(0, layout.num_tokens)
    device = layout.segment_of.device
    query = torch.arange(layout.num_tokens, device=device)[rows]
    keys = torch.arange(layout.num_tokens, device=device)
    causal = keys[None, :] <= query[:, None]
    lineage = layout.visible[layout.segment_of[rows]][:, layout.segment_of]
    return causal & lineage


def lineage_predecessor(layout: PackedLayout) -> torch.Tensor:
    """``[T]`` index of the previous token in each token's lineage, ``-1`` at a root's start."""
    prev = torch.arange(layout.num_tokens, device=layout.segment_of.device) - 1
    first = layout.starts
    parent_last = torch.where(layout.parent >= 0, layout.ends[layout.parent.clamp(min=0)] - 1, -1)
    prev[first] = parent_last
    return prev


def lineage_window(layout: PackedLayout, width: int) -> torch.Tensor:
    """``[T, width]`` token indices a causal convolution of ``width`` reads, oldest first.

    Column ``width - 1`` is the token itself; ``-1`` marks positions before the
    root's start (zero padding, as a sequence without initial state).
    """
    prev = lineage_predecessor(layout)
    cols = [torch.arange(layout.num_tokens, device=prev.device)]
    for _ in range(width - 1):
        last = cols[-1]
        cols.append(torch.where(last >= 0, prev[last.clamp(min=0)], -1))
    return torch.stack(cols[::-1], dim=1)
