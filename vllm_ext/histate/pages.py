"""Copy block pages in and out of the KV tensors vLLM registers with a connector (torch only).

vLLM hands the worker-side connector one tensor per layer whose first
dimension is the block id (attention: ``[num_blocks, ...]`` in the model
dtype; Gated-DeltaNet layers: raw int8 pages). One block id names a page in
every layer of its KV-cache group, so a KV block of the attention group is
the concatenation of that block's page in each attention layer, and a
recurrent-state snapshot is the concatenation of the block's page in each
GDN layer (conv + SSM state, without the padding past the state).

The worker's host tier keeps the uint8 host tensors :meth:`PageCopier.read_host`
returns (bytes only for SSD files). Copies never call ``.numpy()`` on a device
tensor: a page is staged through a host buffer (pinned when the cache is on
CUDA) and, on CUDA, copied on a side stream ordered against the compute stream
with events, so a copy waits for the kernels queued before it (a store for
the forward that wrote the page, a load for any that may still read a reused
block) and a load is complete before the next kernel reads it. A step's stores are one batch
(:meth:`PageCopier.read_many`) and its loads another
(:meth:`PageCopier.write_many`): one synchronization each, not one per block.
"""

from __future__ import annotations

import contextlib
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
        first = next((ts[0] for ts in self._tensors.values() if ts), None)
        self.device = first.device if first is not None else torch.device("cpu")
        self._cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(device=self.device) if self._cuda else None

    def page_bytes(self, group_id: int) -> int:
        """Payload bytes of one block of ``group_id`` (all its layers)."""
        return sum(t[0].numel() * t.element_size() for t in self._tensors[group_id])

    def read_host(self, group_id: int, block_id: int) -> torch.Tensor:
        """The block's pages of every layer of ``group_id``, in one host uint8 tensor."""
        return self.read_many([(group_id, block_id)])[0]

    def read_many(self, blocks: Sequence[tuple[int, int]]) -> list[torch.Tensor]:
        """:meth:`read_host` of each ``(group id, block id)``, in one batch.

        Pinned when the cache is on CUDA; complete when this returns (one
        synchronization for the batch), so the caller may keep them as the
        host tier's copies.
        """
        for _, block_id in blocks:
            self._check(block_id)
        hosts = [
            torch.empty(self.page_bytes(g), dtype=torch.uint8, pin_memory=self._cuda)
            for g, _ in blocks
        ]
        with self._side_stream():
            for (group_id, block_id), host in zip(blocks, hosts, strict=True):
                offset = 0
                for t in self._tensors[group_id]:
                    page = t[block_id].contiguous().view(torch.uint8).reshape(-1)
                    host[offset : offset + page.numel()].copy_(page, non_blocking=self._cuda)
                    offset += page.numel()
        return hosts

    def write_host(self, group_id: int, block_id: int, host: torch.Tensor) -> None:
        """Inverse of :meth:`read_host`: fill the block's pages from a host uint8 tensor."""
        self.write_many([(group_id, block_id, host)])

    def write_many(self, blocks: Sequence[tuple[int, int, torch.Tensor]]) -> None:
        """:meth:`write_host` of each ``(group id, block id, host tensor)``, in one batch.

        Every payload is checked before the first page is written, so a bad
        one leaves all pages as they were.
        """
        for group_id, block_id, host in blocks:
            self._check(block_id)
            expected = self.page_bytes(group_id)
            if host.dtype != torch.uint8 or host.device.type != "cpu" or host.numel() != expected:
                raise PageError(
                    f"payload of {host.numel()} {host.dtype} on {host.device} for group "
                    f"{group_id}, expected {expected} host bytes"
                )
        with self._side_stream():
            for group_id, block_id, host in blocks:
                offset = 0
                for t in self._tensors[group_id]:
                    page = t[block_id]
                    n = page.numel() * page.element_size()
                    src = host[offset : offset + n].to(self.device, non_blocking=self._cuda)
                    page.copy_(src.view(page.dtype).view(page.shape))
                    offset += n

    def read(self, group_id: int, block_id: int) -> bytes:
        """:meth:`read_host` as bytes (the SSD tier's file payload)."""
        # a CPU tensor: .numpy() never touches a device tensor here
        return self.read_host(group_id, block_id).numpy().tobytes()

    def write(self, group_id: int, block_id: int, payload: bytes) -> None:
        """Inverse of :meth:`read`."""
        self.write_host(group_id, block_id, self.to_host(payload))

    def to_host(self, payload: bytes) -> torch.Tensor:
        """``payload`` (e.g. read from the SSD) as a host uint8 tensor, pinned on CUDA."""
        flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        return flat.pin_memory() if self._cuda else flat

    @contextlib.contextmanager
    def _side_stream(self):
        """Run copies on the side stream; on exit the compute stream and the host see them done.

        CPU: a plain block (copies are synchronous). CUDA: the side stream first
        waits for the work queued on the compute stream (a store reads pages the
        forward just wrote; a load overwrites a reused block that kernels still
        queued there may read), the copies run there, and an event makes both
        the compute stream (the next kernels read loaded pages) and the host
        (the host buffer is kept, read or freed next) wait for them.
        """
        if self._stream is None:
            yield
            return
        compute = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(compute)
        done = torch.cuda.Event()
        try:
            with torch.cuda.stream(self._stream):
                yield
        finally:
            # also after a failed copy: the copies queued before it finish before anyone
            # reads the pages or reuses the buffers
            done.record(self._stream)
            compute.wait_event(done)
            done.synchronize()

    def _check(self, block_id: int) -> None:
        if not 0 < block_id < self.num_blocks:
            # block 0 is vLLM's null block: never a real page
            raise PageError(f"block id {block_id} outside 1..{self.num_blocks - 1}")
