"""Copy block pages in and out of the KV tensors vLLM registers with a connector (torch only).

vLLM hands the worker-side connector one tensor per layer whose first
dimension is the block id (attention: ``[num_blocks, ...]`` in the model
dtype; Gated-DeltaNet layers: raw int8 pages). One block id names a page in
every layer of its KV-cache group, so a KV block of the attention group is
the concatenation of that block's page in each attention layer, and a
recurrent-state snapshot is the concatenation of the block's page in each
GDN layer (conv + SSM state, without the padding past the state).

Payloads are plain bytes, so the tiers and the SSD files never see a tensor.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch


class PageError(ValueError):
    """A registered layout or a payload does not fit the pages it is meant for."""


def _pages(value) -> list[torch.Tensor]:
    # a layer may register one tensor or a list of them (per state of a Mamba layer)
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)) and all(isinstance(t, torch.Tensor) for t in value):
        return list(value)
    raise PageError(f"unsupported KV cache entry of type {type(value).__name__}")


class PageCopier:
    """Reads and writes the pages of named layer groups by block id.

    Args:
        kv_caches: what ``register_kv_caches`` received (layer name -> tensor).
        groups: group id -> layer names in that KV-cache group.
        num_blocks: blocks of the shared pool; every tensor must have it as dim 0.
    """

    def __init__(
        self, kv_caches: Mapping[str, object], groups: Mapping[int, Sequence[str]], num_blocks: int
    ):
        self.num_blocks = num_blocks
        self._tensors: dict[int, list[torch.Tensor]] = {}
        for group_id, names in groups.items():
            tensors: list[torch.Tensor] = []
            for name in sorted(names):
                if name not in kv_caches:
                    raise PageError(f"layer {name!r} of KV group {group_id} was not registered")
                for t in _pages(kv_caches[name]):
                    if t.dim() < 1 or t.shape[0] != num_blocks:
                        raise PageError(
                            f"layer {name!r}: first dimension {tuple(t.shape)} is not the "
                            f"{num_blocks} blocks of the pool"
                        )
                    tensors.append(t)
            self._tensors[group_id] = tensors

    def page_bytes(self, group_id: int) -> int:
        """Payload bytes of one block of ``group_id`` (all its layers)."""
        return sum(t[0].numel() * t.element_size() for t in self._tensors[group_id])

    def read(self, group_id: int, block_id: int) -> bytes:
        """The block's pages of every layer of ``group_id``, concatenated."""
        self._check(block_id)
        parts = [
            t[block_id].contiguous().view(torch.uint8).reshape(-1) for t in self._tensors[group_id]
        ]
        return torch.cat(parts).numpy().tobytes()

    def write(self, group_id: int, block_id: int, payload: bytes) -> None:
        """Inverse of :meth:`read`: fill the block's pages from ``payload``."""
        self._check(block_id)
        expected = self.page_bytes(group_id)
        if len(payload) != expected:
            raise PageError(
                f"payload of {len(payload)} bytes for group {group_id}, expected {expected}"
            )
        flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        offset = 0
        for t in self._tensors[group_id]:
            page = t[block_id]
            n = page.numel() * page.element_size()
            src = flat[offset : offset + n].view(page.dtype).view(page.shape)
            page.copy_(src)
            offset += n

    def _check(self, block_id: int) -> None:
        if not 0 < block_id < self.num_blocks:
            # block 0 is vLLM's null block: never a real page
            raise PageError(f"block id {block_id} outside 1..{self.num_blocks - 1}")
