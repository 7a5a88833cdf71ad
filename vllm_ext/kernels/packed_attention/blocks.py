"""Packed attention as a few unmasked flash-attention calls merged by log-sum-exp.

A token sees, in a parent-first layout, every token of each ancestor segment
(no mask needed: ancestors lie wholly before it) and the earlier tokens of its
own segment (plain causal). Softmax over a union of key blocks is the
log-sum-exp merge of the softmaxes over each block, so the result is exact
(to rounding) from:

- one **causal** call per group of similar-length segments, each segment
  against its own tokens (right-padded to the group's longest; with causal
  masking a real row never sees a padded key);
- one **unmasked** call per segment that has descendants: all descendant
  tokens (any depth) as queries against that segment's keys. A context shared
  by 64 questions is read once, by one call whose queries are all 64 questions.

No call carries a mask, so every call takes torch's fused flash kernel instead
of the masked math path; work is linear in the number of questions. On CPU the
flash kernel returns the log-sum-exp we need
(``aten._scaled_dot_product_flash_attention_for_cpu``); elsewhere an explicit
fp32 computation stands in (this path serves CPUs; GPUs use the Triton kernel).
"""

from __future__ import annotations

import torch


def packed_attention_blocks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    starts: torch.Tensor,
    ends: torch.Tensor,
    parent: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Same result as :func:`~.ref.packed_attention_ref` for a parent-first layout.

    Args:
        q: ``[T, Hq, D]``; k, v: ``[T, Hk, D]`` (grouped-query attention allowed).
        starts, ends: ``[S]`` token range of every segment; parent: ``[S]`` (``-1`` = root),
            every parent before its children.
        scale: softmax scale.

    Returns:
        ``[T, Hq, D]`` in ``q.dtype`` (computed in fp32).
    """
    group = q.shape[1] // k.shape[1]
    # [H, T, D] fp32: CPUs without bf16 units run the kernel faster in fp32, and it rounds less
    qh = q.transpose(0, 1).float()
    kh = k.transpose(0, 1).float().repeat_interleave(group, dim=0)
    vh = v.transpose(0, 1).float().repeat_interleave(group, dim=0)
    bounds = list(zip(starts.tolist(), ends.tolist(), strict=True))
    out, lse = _own_segments(qh, kh, vh, bounds, scale)
    for seg, rows in _descendant_rows(bounds, parent.tolist(), q.device).items():
        lo, hi = bounds[seg]
        part, part_lse = _attend(qh[:, rows], kh[:, lo:hi], vh[:, lo:hi], False, scale)
        out[:, rows], lse[:, rows] = _merge(out[:, rows], lse[:, rows], part, part_lse)
    return out.transpose(0, 1).to(q.dtype)


def _own_segments(qh, kh, vh, bounds, scale):
    """Causal attention of every segment to itself, segments batched by padded length."""
    heads, num_tokens, dim = qh.shape
    out = qh.new_empty(heads, num_tokens, dim)
    lse = qh.new_empty(heads, num_tokens)
    for group in _length_groups(bounds):
        width = max(hi - lo for lo, hi in group)
        # padded slots read token 0; causal masking keeps real rows from seeing them
        index = torch.zeros(len(group), width, dtype=torch.long, device=qh.device)
        valid = torch.zeros(len(group), width, dtype=torch.bool, device=qh.device)
        for row, (lo, hi) in enumerate(group):
            index[row, : hi - lo] = torch.arange(lo, hi, device=qh.device)
            valid[row, : hi - lo] = True
        batch = [t[:, index].transpose(0, 1) for t in (qh, kh, vh)]  # [B, H, W, D]
        part, part_lse = _attend(*batch, True, scale)
        rows = index[valid]
        out[:, rows] = part.transpose(0, 1)[:, valid]
        lse[:, rows] = part_lse.transpose(0, 1)[:, valid]
    return out, lse


def _length_groups(bounds: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """Segments grouped by the power of two above their length: padding at most doubles work."""
    groups: dict[int, list[tuple[int, int]]] = {}
    for lo, hi in bounds:
        if hi > lo:
            groups.setdefault((hi - lo - 1).bit_length(), []).append((lo, hi))
    return list(groups.values())


def _descendant_rows(bounds, parents: list[int], device) -> dict[int, torch.Tensor]:
    """For every segment with descendants: the token indices of all of them."""
    ranges: dict[int, list[torch.Tensor]] = {}
    for seg, (lo, hi) in enumerate(bounds):
        own = torch.arange(lo, hi, device=device)
        ancestor = parents[seg]
        while ancestor >= 0:
            ranges.setdefault(ancestor, []).append(own)
            ancestor = parents[ancestor]
    return {seg: torch.cat(parts) for seg, parts in ranges.items()}


def _attend(q, k, v, causal: bool, scale: float):
    """``(out, lse)`` of attention of q ``[..., H, Lq, D]`` over k, v ``[..., H, Lk, D]``."""
    squeeze = q.dim() == 3
    if squeeze:
        q, k, v = q[None], k[None], v[None]
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=None, scale=scale
        )
    else:
        scores = (q @ k.transpose(-1, -2)) * scale
        if causal:
            rows, cols = scores.shape[-2:]
            scores = scores.masked_fill(
                torch.ones(rows, cols, dtype=torch.bool, device=q.device).triu(1), float("-inf")
            )
        lse = torch.logsumexp(scores, dim=-1)
        out = torch.softmax(scores, dim=-1) @ v
    return (out[0], lse[0]) if squeeze else (out, lse)


def _merge(out_a, lse_a, out_b, lse_b):
    """Attention over the union of two disjoint key sets, from each one's output and lse."""
    lse = torch.logaddexp(lse_a, lse_b)
    out = out_a * torch.exp(lse_a - lse)[..., None] + out_b * torch.exp(lse_b - lse)[..., None]
    return out, lse
