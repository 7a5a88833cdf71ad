"""Packed attention through ``torch.nn.functional.scaled_dot_product_attention``.

The portable fast path (CPU, or GPU without Triton): query rows in chunks, each
against only the keys its rows can see — from the first token of the chunk's
earliest root segment to the chunk's last row — with a boolean mask, so memory
stays ``O(chunk × T)``, not ``O(T²)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def packed_attention_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segment_of: torch.Tensor,
    visible: torch.Tensor,
    scale: float,
    key_start: torch.Tensor | None = None,
    chunk: int = 512,
) -> torch.Tensor:
    """Same contract as :func:`~.ref.packed_attention_ref`.

    Args:
        key_start: ``[T]`` optional first key index any row may see (e.g. the
            start of its root segment); narrows each chunk's key range.
        chunk: query rows per SDPA call.
    """
    if q.device.type == "cpu" and q.dtype != torch.float32:
        # CPUs without bf16 units (AVX2) run SDPA faster in fp32, and it accumulates better
        out = packed_attention_sdpa(q.float(), k.float(), v.float(), segment_of, visible, scale,
                                    key_start, chunk)  # fmt: skip
        return out.to(q.dtype)
    num_tokens = q.shape[0]
    group = q.shape[1] // k.shape[1]
    # [H, T, D] layout for SDPA; expand kv heads once for grouped-query attention
    qh = q.transpose(0, 1)
    kh = k.transpose(0, 1).repeat_interleave(group, dim=0)
    vh = v.transpose(0, 1).repeat_interleave(group, dim=0)
    out = torch.empty_like(qh)
    rows_all = torch.arange(num_tokens, device=q.device)
    for lo in range(0, num_tokens, chunk):
        hi = min(lo + chunk, num_tokens)
        first = int(key_start[lo:hi].min()) if key_start is not None else 0
        rows, keys = rows_all[lo:hi], rows_all[first:hi]
        mask = (keys[None, :] <= rows[:, None]) & visible[segment_of[rows]][:, segment_of[keys]]
        out[:, lo:hi] = F.scaled_dot_product_attention(
            qh[:, lo:hi], kh[:, first:hi], vh[:, first:hi], attn_mask=mask, scale=scale
        )
    return out.transpose(0, 1)
