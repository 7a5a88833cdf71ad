"""Ground truth for packed (segment-masked) attention: explicit fp32 math, any device.

``out[i] = softmax_j(scale * q[i]·k[j] | mask[i, j]) @ v`` with
``mask[i, j] = j <= i and visible[segment_of[i], segment_of[j]]``.
"""

from __future__ import annotations

import torch


def packed_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segment_of: torch.Tensor,
    visible: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Segment-masked causal attention.

    Args:
        q: ``[T, Hq, D]``.
        k, v: ``[T, Hk, D]``, ``Hq`` a multiple of ``Hk`` (grouped-query attention).
        segment_of: ``[T]`` segment of every token.
        visible: ``[S, S]`` bool, ``visible[a, b]``: segment ``a`` may attend to ``b``.
        scale: softmax scale.

    Returns:
        ``[T, Hq, D]`` in ``q.dtype``.
    """
    num_tokens, num_heads, _ = q.shape
    group = num_heads // k.shape[1]
    idx = torch.arange(num_tokens, device=q.device)
    mask = (idx[None, :] <= idx[:, None]) & visible[segment_of][:, segment_of]
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("ihd,jhd->hij", q.float(), kf) * scale
    scores = scores.masked_fill(~mask[None], float("-inf"))
    out = torch.einsum("hij,jhd->ihd", torch.softmax(scores, dim=-1), vf)
    return out.to(q.dtype)
