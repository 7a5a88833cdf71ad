"""Packed attention as one Triton flash-attention kernel.

One program per (query tile, query head): it streams the key tiles its rows
can see, with an online softmax accumulated in fp32, so nothing of size
``T × T`` is ever materialised. The mask of a (query tile, key tile) pair is
built in registers from the two tiles' segment ids — ``visible[seg_q, seg_k]``
gathered from an int8 ``[S, S]`` matrix — and causality. Key tiles after the
query tile's last row are never visited, nor, when ``key_start`` is given,
those before the smallest ``key_start`` of the tile's rows.

Triton comes from :mod:`vllm_ext.kernels.triton_support` (guarded import; ``TRITON_INTERPRET=1``
runs the kernel on CPU through Triton's interpreter, for tests).
"""

from __future__ import annotations

import math

import torch

from vllm_ext.kernels.triton_support import TRITON_AVAILABLE, tl, triton

__all__ = ["TRITON_AVAILABLE", "packed_attention_triton", "supports_head_dim"]

MAX_HEAD_DIM = 256
# tl.dot needs every operand dimension to be at least 16
MIN_BLOCK = 16


def packed_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segment_of: torch.Tensor,
    visible: torch.Tensor,
    scale: float,
    key_start: torch.Tensor | None = None,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """Same contract as :func:`~.ref.packed_attention_ref`, in one kernel launch.

    Args:
        q: ``[T, Hq, D]``; ``D`` a power of two in ``[16, 256]``.
        k, v: ``[T, Hk, D]``, ``Hq`` a multiple of ``Hk`` (grouped-query attention).
        segment_of: ``[T]`` integer segment of every token.
        visible: ``[S, S]`` bool, ``visible[a, b]``: segment ``a`` may attend to ``b``.
        scale: softmax scale.
        key_start: ``[T]`` optional first key index row ``i`` may see; every key
            before it must be masked anyway (e.g. the start of ``i``'s root
            segment). Only used to skip key tiles.
        block_m, block_n: query / key rows per tile (powers of two >= 16);
            default by head size.

    Returns:
        ``[T, Hq, D]`` in ``q.dtype``, contiguous.

    Raises:
        ValueError: unsupported head size, block size or mismatched shapes.
        RuntimeError: Triton is not installed.
    """
    _check_inputs(q, k, v, segment_of, visible, key_start)
    block_m, block_n = _block_sizes(q.shape[2], block_m, block_n)
    if not TRITON_AVAILABLE:
        raise RuntimeError("packed_attention_triton needs Triton, which is not installed")
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if q.shape[0] == 0:
        return out
    q, k, v = (t if t.stride(2) == 1 else t.contiguous() for t in (q, k, v))
    _launch(q, k, v, out, segment_of, visible, scale, key_start, block_m, block_n)
    return out


def _check_inputs(q, k, v, segment_of, visible, key_start) -> None:
    """Raise ``ValueError`` for shapes the kernel cannot (or should not) run."""
    if q.dim() != 3 or k.shape != v.shape or k.dim() != 3:
        raise ValueError(
            f"want q [T, Hq, D], k = v [T, Hk, D]; got {q.shape}, {k.shape}, {v.shape}"
        )
    num_tokens, num_heads, head_dim = q.shape
    if k.shape[0] != num_tokens or k.shape[2] != head_dim or num_heads % k.shape[1]:
        raise ValueError(f"k/v {tuple(k.shape)} do not match q {tuple(q.shape)}")
    if not supports_head_dim(head_dim):
        raise ValueError(f"head size {head_dim} must be a power of two in [16, {MAX_HEAD_DIM}]")
    if segment_of.shape != (num_tokens,):
        raise ValueError(f"segment_of {tuple(segment_of.shape)} must be [{num_tokens}]")
    if visible.dim() != 2 or visible.shape[0] != visible.shape[1]:
        raise ValueError(f"visible {tuple(visible.shape)} must be square [S, S]")
    if key_start is not None and key_start.shape != (num_tokens,):
        raise ValueError(f"key_start {tuple(key_start.shape)} must be [{num_tokens}]")


def supports_head_dim(head_dim: int) -> bool:
    """Whether the kernel runs this head size: a power of two in ``[16, 256]``."""
    return _is_pow2(head_dim) and MIN_BLOCK <= head_dim <= MAX_HEAD_DIM


def _block_sizes(head_dim: int, block_m: int | None, block_n: int | None) -> tuple[int, int]:
    """Tile sizes: 64 × 64, narrower key tiles at ``D = 256`` to bound registers."""
    block_m = block_m or 64
    block_n = block_n or (64 if head_dim <= 128 else 32)
    for name, size in (("block_m", block_m), ("block_n", block_n)):
        if not _is_pow2(size) or size < MIN_BLOCK:
            raise ValueError(f"{name}={size} must be a power of two >= {MIN_BLOCK}")
    return block_m, block_n


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _launch(q, k, v, out, segment_of, visible, scale, key_start, block_m, block_n) -> None:
    """Launch one program per (query tile, query head)."""
    num_tokens, num_heads, head_dim = q.shape
    # bool has no pointer arithmetic in Triton; int8 has the same bytes
    vis = visible.contiguous().view(torch.int8) if visible.dtype == torch.bool else visible
    grid = (triton.cdiv(num_tokens, block_m), num_heads)
    _packed_attention_kernel[grid](
        q, k, v, out, segment_of.contiguous(), vis.contiguous(),
        # any tensor stands in when there is no key_start: HAS_KEY_START=False never reads it
        key_start.contiguous() if key_start is not None else segment_of,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        num_tokens, visible.shape[0], num_heads // k.shape[1],
        # exp2 is the native instruction: fold log2(e) into the scale
        scale * math.log2(math.e),
        HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n,
        HAS_KEY_START=key_start is not None,
        # fp32 inputs: full-precision dot, not tf32, to match the fp32 reference
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4 if head_dim <= 64 else 8,
    )  # fmt: skip


if TRITON_AVAILABLE:

    @triton.jit
    def _key_range(ks_ptr, offs_m, row_ok, tile, num_tokens,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   HAS_KEY_START: tl.constexpr):  # fmt: skip
        """First (aligned to BLOCK_N) and one-past-last key index the tile's rows may see."""
        lo = 0
        if HAS_KEY_START:
            starts = tl.load(ks_ptr + offs_m, mask=row_ok, other=num_tokens)
            lo = (tl.min(starts, axis=0).to(tl.int32) // BLOCK_N) * BLOCK_N
        # causal: no row of the tile sees past the tile's last row
        hi = tl.minimum((tile + 1) * BLOCK_M, num_tokens)
        return lo, hi

    @triton.jit
    def _tile_mask(seg_ptr, vis_ptr, seg_q, offs_m, offs_n, num_tokens, num_segments):
        """``[BLOCK_M, BLOCK_N]`` True where a row may attend to a key: causal and visible."""
        col_ok = offs_n < num_tokens
        seg_k = tl.load(seg_ptr + offs_n, mask=col_ok, other=0)
        # [S, S] is tiny and shared by every program, so these gathers stay in cache
        seen = tl.load(vis_ptr + seg_q[:, None] * num_segments + seg_k[None, :])
        causal = offs_n[None, :] <= offs_m[:, None]
        return causal & col_ok[None, :] & (seen != 0)

    @triton.jit
    def _online_softmax_step(q, k, v, mask, acc, m_i, l_i, qk_scale, PRECISION: tl.constexpr):
        """Fold one key tile into the running max ``m_i``, sum ``l_i`` and output ``acc``."""
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        qk = tl.where(mask, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        # a row with nothing visible yet keeps max -inf; subtracting 0 instead avoids inf - inf
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(qk - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        acc = acc * alpha[:, None] + pv
        return acc, m_new, l_i

    @triton.jit
    def _packed_attention_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, seg_ptr, vis_ptr, ks_ptr,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
        num_tokens, num_segments, group, qk_scale,
        HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        HAS_KEY_START: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        """Output rows ``[tile * BLOCK_M, (tile + 1) * BLOCK_M)`` of query head ``head``."""
        tile = tl.program_id(0)
        head = tl.program_id(1)
        kv_head = head // group  # grouped-query attention: consecutive query heads share kv
        offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        row_ok = offs_m < num_tokens
        # int64 offsets: token × stride overflows int32 for long packed sequences
        rows = offs_m.to(tl.int64)
        q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                    mask=row_ok[:, None], other=0.0)  # fmt: skip
        seg_q = tl.load(seg_ptr + offs_m, mask=row_ok, other=0)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        lo, hi = _key_range(ks_ptr, offs_m, row_ok, tile, num_tokens,
                            BLOCK_M, BLOCK_N, HAS_KEY_START)  # fmt: skip
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            col_ok = offs_n < num_tokens
            cols = offs_n.to(tl.int64)
            k = tl.load(k_ptr + cols[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :],
                        mask=col_ok[:, None], other=0.0)  # fmt: skip
            v = tl.load(v_ptr + cols[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :],
                        mask=col_ok[:, None], other=0.0)  # fmt: skip
            mask = _tile_mask(seg_ptr, vis_ptr, seg_q, offs_m, offs_n, num_tokens, num_segments)
            acc, m_i, l_i = _online_softmax_step(q, k, v, mask, acc, m_i, l_i, qk_scale,
                                                 PRECISION)  # fmt: skip
        # every real row sees itself (l > 0); padding rows are never stored
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])  # fmt: skip
