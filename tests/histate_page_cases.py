"""Shared cases for PageCopier: random layouts, store -> overwrite -> load gives the same pages."""

from __future__ import annotations

import random

import pytest
import torch

from vllm_ext.histate.pages import PageCopier, PageError


def random_caches(seed: int, device: str):
    """A random hybrid-like layout: attention layers in a model dtype, GDN layers as int8 pages."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    num_blocks = rng.randint(3, 9)
    caches, groups = {}, {0: [], 1: []}
    for i in range(rng.randint(1, 3)):
        shape = (num_blocks, 2, rng.randint(1, 4), rng.randint(1, 8), rng.choice((4, 8)))
        dtype = rng.choice((torch.float32, torch.bfloat16, torch.float16))
        caches[f"attn.{i}"] = torch.randn(shape, generator=gen).to(dtype).to(device)
        groups[0].append(f"attn.{i}")
    for i in range(rng.randint(1, 3)):
        pages = [
            torch.randint(-128, 128, (num_blocks, rng.randint(1, 64)), generator=gen,
                          dtype=torch.int8).to(device)
            for _ in range(rng.randint(1, 2))
        ]  # fmt: skip
        caches[f"gdn.{i}"] = pages
        groups[1].append(f"gdn.{i}")
    return caches, groups, num_blocks


def check_store_evict_load(device: str, seeds=range(8)) -> None:
    """Read a block, scribble over it (evicted, reused device block), write it back: identical."""
    for seed in seeds:
        caches, groups, num_blocks = random_caches(seed, device)
        copier = PageCopier(caches, groups, num_blocks)
        assert copier.device.type == torch.device(device).type
        rng = random.Random(seed)
        for group_id in groups:
            block = rng.randint(1, num_blocks - 1)
            before = {n: _pages_of(caches[n], block) for n in groups[group_id]}
            payload = copier.read(group_id, block)
            assert isinstance(payload, bytes) and len(payload) == copier.page_bytes(group_id)
            for name in groups[group_id]:
                for t in caches[name] if isinstance(caches[name], list) else [caches[name]]:
                    t[block].zero_()
            target = rng.choice([b for b in range(1, num_blocks) if b != block] or [block])
            copier.write(group_id, target, payload)
            for name in groups[group_id]:
                assert all(
                    torch.equal(a, b)
                    for a, b in zip(before[name], _pages_of(caches[name], target), strict=True)
                ), (seed, name)


def _pages_of(value, block: int) -> list[torch.Tensor]:
    tensors = value if isinstance(value, list) else [value]
    return [t[block].clone().cpu() for t in tensors]


def check_batches(device: str, seeds=range(8)) -> None:
    """A batch of reads/writes over random blocks of both groups equals the copies one by one;
    a batch with one bad payload writes nothing."""
    for seed in seeds:
        caches, groups, num_blocks = random_caches(seed, device)
        copier = PageCopier(caches, groups, num_blocks)
        rng = random.Random(seed)
        blocks = [(g, rng.randint(1, num_blocks - 1)) for _ in range(6) for g in groups]
        batch = copier.read_many(blocks)
        assert all(h.device.type == "cpu" for h in batch)
        assert all(
            torch.equal(h, copier.read_host(g, b)) for (g, b), h in zip(blocks, batch, strict=True)
        ), seed
        targets = [(g, rng.randint(1, num_blocks - 1)) for g, _ in blocks]
        before = {(n, b): _pages_of(caches[n], b) for (g, b) in targets for n in groups[g]}
        bad = torch.zeros(copier.page_bytes(0) + 1, dtype=torch.uint8)
        writes = [(g, b, h) for (g, b), h in zip(targets, batch, strict=True)]
        with pytest.raises(PageError, match="expected"):
            copier.write_many([*writes, (0, 1, bad)])
        assert all(
            torch.equal(a, c)
            for (g, b) in targets
            for n in groups[g]
            for a, c in zip(before[n, b], _pages_of(caches[n], b), strict=True)
        ), seed
        copier.write_many(writes)
        # the last write of a block wins, as one by one
        last = {(g, b): h for g, b, h in writes}
        assert all(torch.equal(copier.read_host(g, b), h) for (g, b), h in last.items()), seed
