"""Flide's lineage convolution in bf16 rounds as vLLM's conv ops do.

Two roundings (bf16 conv output, then SiLU in bf16) differ from vLLM's op by
one bf16 step on about a quarter of the elements, which is enough to flip a
MoE router's top-k where two experts nearly tie. These tests use bf16 inputs,
because fp32 inputs cannot see that.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from vllm_ext.flide.packing import lineage_window, pack_segments
from vllm_ext.flide.recurrent import lineage_conv

# contexts of 40 and 7 tokens; questions under them (one shorter than the conv width);
# a two-token label continuation under a one-token question (its window reaches the context)
SEGMENT_LENGTHS = [40, 9, 1, 7, 2, 2, 5]
PARENTS = [-1, 0, 0, -1, 3, 2, 3]
CHANNELS, WIDTH = 256, 4


def lineages(layout):
    out = []
    for s in range(layout.num_segments):
        chain, seg = [], s
        while seg >= 0:
            chain.insert(0, seg)
            seg = int(layout.parent[seg])
        out.append(torch.cat([torch.arange(layout.starts[c], layout.ends[c]) for c in chain]))
    return out


def bf16_case(seed: int = 0):
    torch.manual_seed(seed)
    offset = 0
    segments = []
    for n in SEGMENT_LENGTHS:
        segments.append(list(range(offset, offset + n)))
        offset += n
    layout = pack_segments(segments, PARENTS)
    x = torch.randn(layout.num_tokens, CHANNELS).bfloat16()
    weight = (torch.randn(CHANNELS, WIDTH) * 0.5).bfloat16()
    bias = (torch.randn(CHANNELS) * 0.1).bfloat16()
    return layout, x, weight, bias


def round_once(x, weight, bias):
    """fp32 convolution and SiLU of one sequence, rounded to bf16 once: ``[N, C]``."""
    seq = F.pad(x.float().T[None], (WIDTH - 1, 0))
    acc = F.conv1d(seq, weight.float()[:, None, :], bias.float(), groups=CHANNELS)[0].T
    return F.silu(acc).to(x.dtype)


def test_lineage_conv_in_bf16_rounds_once():
    layout, x, weight, bias = bf16_case()
    out = lineage_conv(x, weight, bias, lineage_window(layout, WIDTH), "silu")
    assert out.dtype == torch.bfloat16
    for s, lineage in enumerate(lineages(layout)):
        n = int(layout.ends[s] - layout.starts[s])
        ref = round_once(x[lineage], weight, bias)[-n:]
        torch.testing.assert_close(out[layout.starts[s] : layout.ends[s]], ref, rtol=0, atol=0)


def vllm_ops():
    pytest.importorskip("vllm")
    from vllm import _custom_ops as ops

    return ops


def cpp_conv_available() -> bool:
    # the predicate vLLM's CPU GDN path uses to pick its C++ conv op
    from vllm.model_executor.layers.mamba.ops.cpu.gdn_attention import is_arm_bf16

    return torch.cpu._is_avx512_bf16_supported() or is_arm_bf16()


def vllm_conv_alone(ops, x, weight, bias, packed: bool):
    """vLLM's CPU conv on one sequence from zero state: ``[N, C]``."""
    from vllm.model_executor.layers.mamba.ops.cpu.causal_conv1d import causal_conv1d_fn_cpu

    states = torch.zeros(1, WIDTH - 1, CHANNELS, dtype=x.dtype).transpose(1, 2)
    args = dict(bias=bias, conv_states=states, cache_indices=torch.zeros(1, dtype=torch.int32),
                query_start_loc=torch.tensor([0, x.shape[0]], dtype=torch.int32),
                has_initial_state=torch.zeros(1, dtype=torch.bool))  # fmt: skip
    if packed:
        taps = ops.causal_conv1d_weight_pack(weight.contiguous())
        out = ops.causal_conv1d_fwd_cpu(x=x.t(), weight=taps, silu_activation=True,
                                        is_weight_packed=True, **args)  # fmt: skip
    else:
        out = causal_conv1d_fn_cpu(x=x.t(), weight=weight, activation="silu", **args)
    return out.t()


def test_lineage_conv_matches_vllms_cpp_conv_op():
    ops = vllm_ops()
    if not cpp_conv_available():
        pytest.skip("vLLM's C++ conv op needs AVX-512 BF16 or Arm BF16")
    layout, x, weight, bias = bf16_case()
    out = lineage_conv(x, weight, bias, lineage_window(layout, WIDTH), "silu")
    differ = total = 0
    for s, lineage in enumerate(lineages(layout)):
        n = int(layout.ends[s] - layout.starts[s])
        ref = vllm_conv_alone(ops, x[lineage], weight, bias, packed=True)[-n:]
        got = out[layout.starts[s] : layout.ends[s]]
        # fp32 sums in another order: at most one bf16 step, and rarely
        torch.testing.assert_close(got, ref, rtol=2**-7, atol=2**-9)
        differ += int((got != ref).sum())
        total += got.numel()
    assert differ / total < 0.02, f"{differ / total:.1%} of elements differ from vLLM's op"


@pytest.mark.parametrize("packed", [True, False], ids=["cpp-op", "torch-fallback"])
def test_packed_cpu_conv_equals_vllms_op_on_each_lineage(packed):
    ops = vllm_ops()
    if packed and not cpp_conv_available():
        pytest.skip("vLLM's C++ conv op needs AVX-512 BF16 or Arm BF16")
    from vllm_ext.flide.forward import cpu_lineage_conv

    layout, x, weight, bias = bf16_case(1)
    conv1d = SimpleNamespace(weight=weight[:, None, :], bias=bias)
    if packed:
        conv1d = SimpleNamespace(weight=ops.causal_conv1d_weight_pack(weight.contiguous()),
                                 bias=bias, _cpu_unpacked_conv_weight=weight)  # fmt: skip
    layer = SimpleNamespace(conv1d=conv1d, activation="silu")
    out = cpu_lineage_conv(layer, x, layout, lineage_window(layout, WIDTH))
    for s, lineage in enumerate(lineages(layout)):
        n = int(layout.ends[s] - layout.starts[s])
        ref = vllm_conv_alone(ops, x[lineage], weight, bias, packed)[-n:]
        torch.testing.assert_close(out[layout.starts[s] : layout.ends[s]], ref, rtol=0, atol=0)
