"""Flide's packed layout, lineage convolution and segmented delta rule equal separate runs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllm_ext.flide.batch import Item, label_logprobs, pack_items
from vllm_ext.flide.packing import attention_mask, lineage_window, pack_segments
from vllm_ext.flide.recurrent import ReferenceDeltaRule, lineage_conv, segmented_delta_rule
from vllm_ext.kernels.packed_attention import packed_attention_ref

# two contexts; questions under each; a label continuation under question 2
SEGMENTS = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10], [11], [12, 13]]
PARENTS = [-1, 0, 0, -1, 3, 2]


def lineages(layout):
    """Token indices of every segment's whole lineage, oldest first."""
    out = []
    for s in range(layout.num_segments):
        chain, seg = [], s
        while seg >= 0:
            chain.insert(0, seg)
            seg = int(layout.parent[seg])
        out.append(torch.cat([torch.arange(layout.starts[c], layout.ends[c]) for c in chain]))
    return out


def test_positions_continue_from_the_parent():
    layout = pack_segments(SEGMENTS, PARENTS)
    assert layout.positions.tolist() == [0, 1, 2, 3, 4, 3, 0, 1, 2, 3, 4, 4, 5]
    assert layout.depth.tolist() == [0, 1, 1, 0, 1, 2]
    assert layout.root.tolist() == [0, 0, 0, 3, 3, 0]


def test_mask_sees_exactly_the_lineage_causally():
    layout = pack_segments(SEGMENTS, PARENTS)
    mask = attention_mask(layout)
    for s, lineage in enumerate(lineages(layout)):
        for row in range(int(layout.starts[s]), int(layout.ends[s])):
            seen = torch.nonzero(mask[row]).flatten().tolist()
            assert seen == [t for t in lineage.tolist() if t <= row]


def test_lineage_window_crosses_into_the_parent():
    layout = pack_segments(SEGMENTS, PARENTS)
    window = lineage_window(layout, 4)
    assert window[5].tolist() == [0, 1, 2, 5]  # question (token 5) reads its context 0..2
    assert window[11].tolist() == [1, 2, 5, 11]  # label under question 2: ctx tail + question
    assert window[0].tolist() == [-1, -1, -1, 0]


def test_attention_equals_each_lineage_alone():
    torch.manual_seed(0)
    layout = pack_segments(SEGMENTS, PARENTS)
    q, k, v = (torch.randn(layout.num_tokens, h, 16) for h in (4, 2, 2))
    out = packed_attention_ref(q, k, v, layout.segment_of, layout.visible, 0.25)
    for s, lineage in enumerate(lineages(layout)):
        alone = pack_segments([lineage.tolist()], [-1])
        ref = packed_attention_ref(q[lineage], k[lineage], v[lineage], alone.segment_of,
                                   alone.visible, 0.25)  # fmt: skip
        own = slice(int(layout.starts[s]), int(layout.ends[s]))
        torch.testing.assert_close(out[own], ref[-(own.stop - own.start) :])


def test_lineage_conv_equals_conv1d_on_each_lineage():
    torch.manual_seed(0)
    layout = pack_segments(SEGMENTS, PARENTS)
    x, weight, bias = torch.randn(layout.num_tokens, 6), torch.randn(6, 4), torch.randn(6)
    out = lineage_conv(x, weight, bias, lineage_window(layout, 4), "silu")
    for s, lineage in enumerate(lineages(layout)):
        seq = F.pad(x[lineage].T[None], (3, 0))
        ref = F.silu(F.conv1d(seq, weight[:, None, :], bias, groups=6))[0].T
        n = int(layout.ends[s] - layout.starts[s])
        torch.testing.assert_close(out[layout.starts[s] : layout.ends[s]], ref[-n:])


def test_segmented_delta_rule_equals_each_lineage_alone():
    torch.manual_seed(0)
    layout = pack_segments(SEGMENTS, PARENTS)
    n, hk, h, d = layout.num_tokens, 1, 2, 8
    q, k, v = torch.randn(n, hk, d), torch.randn(n, hk, d), torch.randn(n, h, d)
    g, beta = -torch.rand(n, h), torch.rand(n, h)
    kernel = ReferenceDeltaRule()
    out = segmented_delta_rule(layout, q, k, v, g, beta, kernel)
    for s, lin in enumerate(lineages(layout)):
        cu = torch.tensor([0, lin.numel()], dtype=torch.int32)
        ref, _ = kernel(q[lin][None], k[lin][None], v[lin][None], g[lin][None], beta[lin][None],
                        kernel.zero_states(1, h, d, d, "cpu"), cu)  # fmt: skip
        m = int(layout.ends[s] - layout.starts[s])
        torch.testing.assert_close(out[layout.starts[s] : layout.ends[s]], ref[0, -m:])


def test_label_scores_sum_teacher_forced_tokens():
    items = [Item((1, 2), ((3,), (4, 5)))]
    labels = [(7,), (8, 9, 10)]
    batch = pack_items(items, labels)
    # ctx, q0, q0-label1 [8, 9], q1, q1-label1 [8, 9]
    assert batch.layout.num_segments == 5
    assert batch.layout.parent.tolist() == [-1, 0, 1, 0, 3]
    vocab = 12
    logprobs = torch.log_softmax(torch.randn(batch.readout_rows.numel(), vocab), -1)
    logp = label_logprobs(batch, logprobs)
    rows = {int(r): i for i, r in enumerate(batch.readout_rows)}
    q0_last, cont = 2, (3, 4)  # tokens: ctx 0,1 | q0 2 | cont 3,4 | q1 5,6 | cont 7,8
    want_q0 = [
        logprobs[rows[q0_last], 7],
        logprobs[rows[q0_last], 8] + logprobs[rows[cont[0]], 9] + logprobs[rows[cont[1]], 10],
    ]
    torch.testing.assert_close(logp[0], torch.stack(want_q0))


@pytest.mark.parametrize("bad", [([[]], [-1]), ([[1]], [0]), ([[1], [2]], [-1])])
def test_malformed_segments_raise(bad):
    tokens, parents = bad
    with pytest.raises(ValueError):
        pack_segments(tokens, parents)


def test_block_attention_equals_the_reference():
    from vllm_ext.kernels.packed_attention.blocks import packed_attention_blocks

    torch.manual_seed(1)
    layout = pack_segments(SEGMENTS, PARENTS)
    q, k, v = (torch.randn(layout.num_tokens, h, 16) for h in (4, 2, 2))
    ref = packed_attention_ref(q, k, v, layout.segment_of, layout.visible, 0.25)
    out = packed_attention_blocks(q, k, v, layout.starts, layout.ends, layout.parent, 0.25)
    torch.testing.assert_close(out, ref)
