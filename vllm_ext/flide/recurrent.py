"""Gated DeltaNet over a packed layout: every segment starts from its parent's final state.

Two pieces of a GDN layer depend on the sequence structure:

- the short causal convolution, which reads the ``w - 1`` previous inputs of
  the token's *lineage* (:func:`lineage_conv`); a question's first tokens read
  the end of its context, a context's first tokens read zeros;
- the gated delta rule, run depth by depth (:func:`segmented_delta_rule`):
  all roots from zero state in one varlen call, then all their children from
  copies of their parents' final states in the next, and so on. Each context
  is processed once however many questions branch from it.

The delta-rule kernel is injected (:class:`DeltaRule`): vLLM's CPU op or the
FLA Triton op in the adapter, :class:`ReferenceDeltaRule` (step by step, fp32)
in tests. Pure torch, no vLLM.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from vllm_ext.flide.packing import PackedLayout, lineage_window


class DeltaRule(Protocol):
    """A varlen gated-delta-rule kernel with per-sequence initial states."""

    def zero_states(self, num: int, heads: int, k_dim: int, v_dim: int, device) -> torch.Tensor:
        """``num`` zero states in the kernel's own layout (fp32)."""

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        states: torch.Tensor,
        cu_seqlens: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run sequences ``cu_seqlens`` from ``states``; returns ``(out [1, T, H, V], finals)``.

        ``q, k: [1, T, Hk, K]``, ``v: [1, T, H, V]``, ``g: [1, T, H]`` (fp32,
        log decay), ``beta: [1, T, H]``; q and k are L2-normalised by the kernel.
        """


def lineage_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    window: torch.Tensor,
    activation: str | None,
) -> torch.Tensor:
    """Depthwise causal convolution along each token's lineage.

    Args:
        x: ``[T, C]`` inputs.
        weight: ``[C, W]`` taps, oldest first.
        bias: ``[C]`` or None.
        window: ``[T, W]`` from :func:`~vllm_ext.flide.packing.lineage_window`
            (``-1`` = zero padding).
        activation: ``"silu"``/``"swish"`` or None.

    Returns:
        ``[T, C]`` in ``x.dtype``, accumulated and activated in fp32, rounded once.
    """
    num_tokens, width = x.shape[0], weight.shape[1]
    w = weight.float()
    b = bias.float() if bias is not None else None
    # one plain causal convolution over the packed sequence is right for every token
    # whose window stays inside its own segment (zero padding before the first token)
    padded = F.pad(x.float().t()[None], (width - 1, 0))
    acc = F.conv1d(padded, w[:, None, :], b, groups=w.shape[0])[0].t()
    # only the first width - 1 tokens of a segment read elsewhere: their lineage
    plain = torch.arange(num_tokens, device=x.device)[:, None] - (width - 1)
    plain = plain + torch.arange(width, device=x.device)[None, :]
    rows = (window != plain.clamp(min=-1)).any(dim=1).nonzero().squeeze(1)
    if rows.numel():
        src = window[rows]
        taps = x[src.clamp(min=0)].float() * (src >= 0).unsqueeze(2)  # [R, W, C]
        fixed = torch.einsum("rwc,cw->rc", taps, w)
        acc[rows] = fixed + b if b is not None else fixed
    # activation in fp32, one rounding at the end: as vLLM's conv ops and transformers
    out = F.silu(acc) if activation in ("silu", "swish") else acc
    return out.to(x.dtype)


def gdn_gating(
    a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-Next gates: ``g = -exp(A_log) · softplus(a + dt_bias)`` (fp32), ``beta = σ(b)``."""
    g = -torch.exp(a_log.float()) * F.softplus(a.float() + dt_bias.float())
    return g, torch.sigmoid(b.float()).to(b.dtype)


def segmented_delta_rule(
    layout: PackedLayout,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    kernel: DeltaRule,
) -> torch.Tensor:
    """Gated delta rule where each segment continues from its parent's final state.

    Args:
        q, k: ``[T, Hk, K]``; v: ``[T, H, V]``; g, beta: ``[T, H]``.

    Returns:
        ``[T, H, V]`` outputs, as if each lineage were run alone.
    """
    out = torch.empty_like(v)
    finals: torch.Tensor | None = None
    row_of = torch.full((layout.num_segments,), -1, dtype=torch.long, device=q.device)
    depth = 0
    while True:
        segs = layout.segments_at_depth(depth)
        if segs.numel() == 0:
            return out
        tokens, cu_seqlens = _segment_tokens(layout, segs)
        heads, k_dim, v_dim = v.shape[1], q.shape[2], v.shape[2]
        if depth == 0:
            states = kernel.zero_states(segs.numel(), heads, k_dim, v_dim, q.device)
        else:
            # one private copy per child: the kernel writes final states in place
            states = finals[row_of[layout.parent[segs]]].clone()
        seg_out, finals = kernel(
            q[tokens][None], k[tokens][None], v[tokens][None],
            g[tokens][None], beta[tokens][None], states, cu_seqlens,
        )  # fmt: skip
        out[tokens] = seg_out[0]
        row_of[segs] = torch.arange(segs.numel(), device=q.device)
        depth += 1


def _segment_tokens(layout: PackedLayout, segs: torch.Tensor):
    """Token indices of ``segs`` concatenated, and their ``cu_seqlens`` (int32)."""
    starts, lengths = layout.starts[segs], layout.ends[segs] - layout.starts[segs]
    offsets = torch.repeat_interleave(starts - torch.cumsum(lengths, 0) + lengths, lengths)
    tokens = offsets + torch.arange(int(lengths.sum()), device=segs.device)
    cu_seqlens = torch.zeros(segs.numel() + 1, dtype=torch.int32, device=segs.device)
    cu_seqlens[1:] = torch.cumsum(lengths, 0)
    return tokens, cu_seqlens


class ReferenceDeltaRule:
    """Step-by-step gated delta rule in fp32; state ``[N, H, K, V]``.

    ``S ← exp(g)·S;  S += β · k ⊗ (v − Sᵀk);  o = K^-½ · Sᵀq`` with q, k
    L2-normalised; key heads are shared by ``H / Hk`` consecutive value heads.
    """

    def zero_states(self, num, heads, k_dim, v_dim, device):
        return torch.zeros(num, heads, k_dim, v_dim, dtype=torch.float32, device=device)

    def __call__(self, q, k, v, g, beta, states, cu_seqlens):
        group = v.shape[2] // q.shape[2]
        qf = F.normalize(q[0].float(), dim=-1).repeat_interleave(group, dim=1)
        kf = F.normalize(k[0].float(), dim=-1).repeat_interleave(group, dim=1)
        vf, gf, bf = v[0].float(), g[0].float(), beta[0].float()
        scale = q.shape[-1] ** -0.5
        out = torch.empty_like(vf)
        states = states.clone()
        for n in range(cu_seqlens.numel() - 1):
            state = states[n]
            for t in range(int(cu_seqlens[n]), int(cu_seqlens[n + 1])):
                state = state * torch.exp(gf[t])[:, None, None]
                err = vf[t] - torch.einsum("hkv,hk->hv", state, kf[t])
                state = state + bf[t][:, None, None] * torch.einsum("hk,hv->hkv", kf[t], err)
                out[t] = scale * torch.einsum("hkv,hk->hv", state, qf[t])
            states[n] = state
        return out[None].to(v.dtype), states


__all__ = [
    "DeltaRule",
    "ReferenceDeltaRule",
    "gdn_gating",
    "lineage_conv",
    "lineage_window",
    "segmented_delta_rule",
]
