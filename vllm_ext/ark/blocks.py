"""Copy KV blocks out of and into vLLM's paged KV tensors (torch only, no vLLM).

Every attention layer's KV tensor has one dimension indexed by block id
(``num_blocks``); where it sits depends on the attention backend (CPU:
``[num_blocks, kv_heads, block_size, 2 * head_dim]``, flash-attn:
``[2, num_blocks, block_size, kv_heads, head_dim]``), so it is found by size.
A payload is the layers' selected blocks, flattened to bytes, in name order;
the meta describes each layer's slab so the receiver can check it matches its
own cache before writing anything.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch


class LayoutMismatch(ValueError):
    """The payload does not fit this cache (another model, dtype or block size)."""


def block_dim(shape: Sequence[int], num_blocks: int) -> int:
    """The dimension of size ``num_blocks`` (exactly one must exist)."""
    dims = [i for i, size in enumerate(shape) if size == num_blocks]
    if len(dims) != 1:
        raise LayoutMismatch(
            f"cannot find the block dimension of a KV tensor of shape {tuple(shape)} with "
            f"{num_blocks} blocks (matching dims: {dims})"
        )
    return dims[0]


def manager_block_view(tensor: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """``tensor`` with a dimension of size ``num_blocks`` (a view; writes reach the cache).

    vLLM >= 0.34 may split each block into ``k`` kernel blocks along the block
    dimension (size ``num_blocks * k``, kernel block ``j`` of block ``b`` at
    ``b * k + j``); that dimension is unflattened to ``[num_blocks, k]``. A
    tensor without exactly one such dimension is returned as is (:func:`block_dim`
    then names the shape).
    """
    if num_blocks in tensor.shape:
        return tensor
    shape = tensor.shape
    split = [i for i, size in enumerate(shape) if size > num_blocks and size % num_blocks == 0]
    if len(split) != 1:
        return tensor
    dim = split[0]
    return tensor.unflatten(dim, (num_blocks, shape[dim] // num_blocks))


def gather(kv_caches: Mapping[str, torch.Tensor], dims: Mapping[str, int],
           block_ids: Sequence[int], block_size: int) -> tuple[dict, torch.Tensor]:  # fmt: skip
    """``(meta, payload)``: the blocks ``block_ids`` of every layer as one uint8 CPU tensor.

    On an accelerator the copy to host is synchronous here (the blocks may be
    freed once this returns).
    """
    names = sorted(kv_caches)
    layers, parts = [], []
    for name in names:
        tensor = kv_caches[name]
        index = torch.tensor(block_ids, dtype=torch.long, device=tensor.device)
        part = tensor.index_select(dims[name], index).contiguous()
        layers.append([name, str(part.dtype).removeprefix("torch."), list(part.shape),
                       dims[name]])  # fmt: skip
        parts.append(part.view(-1).view(torch.uint8).to("cpu"))
    payload = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
    meta = {"layers": layers, "block_size": block_size, "num_blocks": len(block_ids)}
    return meta, payload


def scatter(kv_caches: Mapping[str, torch.Tensor], dims: Mapping[str, int], meta: Mapping,
            payload: bytearray, block_ids: Sequence[int], first: int, block_size: int
            ) -> int:  # fmt: skip
    """Write payload blocks ``first .. first + len(block_ids) - 1`` into ``block_ids``.

    Every layer is checked before any is written; returns the bytes written.
    """
    layers = meta.get("layers")
    if meta.get("block_size") != block_size:
        raise LayoutMismatch(f"block size {meta.get('block_size')} != ours {block_size}")
    if not isinstance(layers, list) or sorted(row[0] for row in layers) != sorted(kv_caches):
        raise LayoutMismatch("the payload's layers are not this model's layers")
    count = int(meta.get("num_blocks", -1))
    if first < 0 or first + len(block_ids) > count:
        raise LayoutMismatch(f"blocks {first}..{first + len(block_ids) - 1} not in {count}")
    buf = torch.frombuffer(payload, dtype=torch.uint8) if len(payload) else torch.empty(0)
    views, offset = [], 0
    for name, dtype_name, shape, dim in layers:
        tensor = kv_caches[name]
        dtype = getattr(torch, dtype_name, None)
        expected = list(tensor.shape)
        expected[dims[name]] = count
        if dtype != tensor.dtype or list(shape) != expected or dim != dims[name]:
            raise LayoutMismatch(f"layer {name}: {dtype_name}{shape} does not fit "
                                 f"{tensor.dtype}{expected}")  # fmt: skip
        nbytes = math.prod(shape) * tensor.element_size()
        if offset + nbytes > len(payload):
            raise LayoutMismatch(f"payload too short for layer {name}")
        views.append((tensor, dim, buf[offset : offset + nbytes].view(dtype).view(shape)))
        offset += nbytes
    if offset != len(payload):
        raise LayoutMismatch(f"payload has {len(payload) - offset} trailing bytes")
    written = 0
    for tensor, dim, part in views:
        index = torch.tensor(block_ids, dtype=torch.long, device=tensor.device)
        rows = part.narrow(dim, first, len(block_ids)).to(tensor.device)
        tensor.index_copy_(dim, index, rows)
        written += rows.numel() * rows.element_size()
    return written
