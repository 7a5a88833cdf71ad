"""KV block gather/scatter between two paged caches of random layouts."""

from __future__ import annotations

import pytest
import torch

from vllm_ext.ark.blocks import LayoutMismatch, block_dim, gather, manager_block_view, scatter

pytestmark = pytest.mark.unit


def _caches(seed, layout, n_blocks, dtype):
    g = torch.Generator().manual_seed(seed)
    shape = {"cpu": (n_blocks, 3, 16, 2 * 8), "flash": (2, n_blocks, 16, 3, 8)}[layout]
    return {f"model.layers.{i}.attn": torch.randn(shape, generator=g).to(dtype)
            for i in range(3)}  # fmt: skip


@pytest.mark.parametrize("seed", range(12))
def test_blocks_move_exactly_between_caches(seed):
    g = torch.Generator().manual_seed(seed)
    layout = ["cpu", "flash"][seed % 2]
    dtype = [torch.bfloat16, torch.float16, torch.float32][seed % 3]
    src, dst = _caches(seed, layout, 40, dtype), _caches(seed + 100, layout, 33, dtype)
    src_dims = {k: block_dim(v.shape, 40) for k, v in src.items()}
    dst_dims = {k: block_dim(v.shape, 33) for k, v in dst.items()}
    n = int(torch.randint(1, 9, (1,), generator=g))
    src_ids = torch.randperm(40, generator=g)[:n].tolist()
    meta, payload = gather(src, src_dims, src_ids, 16)
    first = int(torch.randint(0, n, (1,), generator=g))
    dst_ids = torch.randperm(33, generator=g)[: n - first].tolist()
    before = {k: v.clone() for k, v in dst.items()}
    scatter(dst, dst_dims, meta, bytearray(payload.numpy().tobytes()), dst_ids, first, 16)
    for name in src:
        d = dst_dims[name]
        for j, dst_id in enumerate(dst_ids):
            got = dst[name].select(d, dst_id)
            assert torch.equal(got, src[name].select(d, src_ids[first + j]))
        untouched = [b for b in range(33) if b not in dst_ids]
        idx = torch.tensor(untouched)
        assert torch.equal(dst[name].index_select(d, idx), before[name].index_select(d, idx))


def test_mismatches_are_refused_before_writing():
    src = _caches(0, "cpu", 10, torch.bfloat16)
    dims = {k: 0 for k in src}
    meta, payload = gather(src, dims, [1, 2], 16)
    data = bytearray(payload.numpy().tobytes())
    other = _caches(1, "cpu", 10, torch.float16)
    with pytest.raises(LayoutMismatch, match="does not fit"):
        scatter(other, dims, meta, data, [3, 4], 0, 16)
    with pytest.raises(LayoutMismatch, match="block size"):
        scatter(src, dims, meta, data, [3, 4], 0, 32)
    with pytest.raises(LayoutMismatch, match="not in"):
        scatter(src, dims, meta, data, [3, 4, 5], 0, 16)
    with pytest.raises(LayoutMismatch, match="trailing|short"):
        scatter(src, dims, meta, data + b"x", [3, 4], 0, 16)
    with pytest.raises(LayoutMismatch, match="block dimension"):
        block_dim((10, 10, 4), 10)


@pytest.mark.parametrize("ratio", [2, 4])
def test_kernel_split_blocks_move_as_whole_blocks(ratio):
    # vLLM >= 0.34 may split each block into `ratio` kernel blocks along the block dim:
    # kernel block j of block b is row b * ratio + j of a [blocks * ratio, heads, 16 // ratio, C]
    g = torch.Generator().manual_seed(ratio)
    src = {"l0": torch.randn(37 * ratio, 3, 16 // ratio, 16, generator=g)}
    dst = {"l0": torch.zeros(29 * ratio, 3, 16 // ratio, 16)}
    src_v = {k: manager_block_view(v, 37) for k, v in src.items()}
    dst_v = {k: manager_block_view(v, 29) for k, v in dst.items()}
    meta, payload = gather(src_v, {"l0": 0}, [4, 30, 11], 16)
    scatter(dst_v, {"l0": 0}, meta, bytearray(payload.numpy().tobytes()), [7, 0, 28], 0, 16)

    def rows(blocks):
        return [b * ratio + j for b in blocks for j in range(ratio)]

    assert torch.equal(dst["l0"][rows([7, 0, 28])], src["l0"][rows([4, 30, 11])])
    assert not dst["l0"][rows([1, 2, 27])].any()
    # a tensor with a plain block dimension, or with no single candidate, is left as is
    plain = torch.zeros(29, 3, 16, 16)
    assert manager_block_view(plain, 29) is plain
    ambiguous = torch.zeros(58, 58, 4)
    assert manager_block_view(ambiguous, 29) is ambiguous
