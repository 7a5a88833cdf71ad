"""Longest usable prefix hit for a hybrid model (no vLLM types).

A prefix of ``k`` blocks can be reused only if the attention KV of all ``k``
blocks is available (device or host tier) **and** a recurrent-state snapshot
taken exactly at the end of block ``k - 1`` exists (any tier): recurrent
state cannot be rolled back, so KV alone is useless past the last snapshot.
A hit therefore reads every matching KV block but exactly one snapshot.

Blocks are named by a hash chain (block ``i``'s hash covers blocks ``0..i``),
so a snapshot is keyed by the hash of the block it ends.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass

# tier name of an item, or None when absent
TierOf = Callable[[str], str | None]


@dataclass(frozen=True)
class Hit:
    """A usable prefix.

    Args:
        blocks: number of leading blocks reused (0 = miss).
        kv_tiers: tier of each reused block's KV (length ``blocks``).
        snapshot_tier: tier of the snapshot at the end of the last reused block.
        kv_blocks_present: leading blocks with KV present (>= ``blocks``).
    """

    blocks: int
    kv_tiers: tuple[str, ...]
    snapshot_tier: str | None
    kv_blocks_present: int

    @property
    def snapshot_hash_index(self) -> int | None:
        """Index in the chain of the block whose end holds the snapshot read."""
        return self.blocks - 1 if self.blocks else None


MISS = Hit(0, (), None, 0)


def longest_hit(
    chain: Sequence[str], kv_tier: TierOf, snapshot_tier: TierOf, max_blocks: int | None = None
) -> Hit:
    """The longest prefix of ``chain`` with KV for every block and a snapshot at its end.

    Args:
        chain: block hashes of the request's full blocks, in order.
        kv_tier: tier holding block hash ``h``'s KV, or None.
        snapshot_tier: tier holding the snapshot at the end of block ``h``, or None.
        max_blocks: cap on the hit (e.g. leave at least one token to compute).
            Default: ``len(chain)``.

    Returns:
        The :class:`Hit`; :data:`MISS` when no block is usable.
    """
    limit = len(chain) if max_blocks is None else max(0, min(max_blocks, len(chain)))
    tiers: list[str] = []
    for block_hash in chain[:limit]:
        tier = kv_tier(block_hash)
        if tier is None:
            break
        tiers.append(tier)
    for k in range(len(tiers), 0, -1):
        snap = snapshot_tier(chain[k - 1])
        if snap is not None:
            return Hit(k, tuple(tiers[:k]), snap, len(tiers))
    return Hit(0, (), None, len(tiers))


def snapshot_positions(
    n_blocks: int, interval: int, *, prompt_end: int | None = None,
    decode_end: int | None = None, branch: int | None = None,
) -> dict[int, str]:  # fmt: skip
    """Candidate snapshot positions (in blocks, 1..n_blocks) of one request and why.

    ``interval`` multiples, the prompt's last full block, the last decoded
    token's full block and a branch point; a position with several reasons
    keeps the strongest (branch > decode_end > prompt_end > interval), which
    matters because policies admit by reason.
    """
    if interval < 1:
        raise ValueError(f"interval must be >= 1, got {interval}")
    out = {k: "interval" for k in range(interval, n_blocks + 1, interval)}
    for reason, pos in (("prompt_end", prompt_end), ("decode_end", decode_end), ("branch", branch)):
        if pos is not None and 1 <= pos <= n_blocks:
            out[pos] = reason
    return out


def recompute_tokens(
    n_blocks: int, snapshot_at: Sequence[int], block_size: int
) -> tuple[list[int], dict[int, int]]:
    """Extra tokens a future hit on this chain loses if one item is removed.

    ``snapshot_at`` are the positions (blocks) holding a snapshot. The chain's
    best hit is the deepest snapshot ``p``. Removing KV block ``j`` (< p)
    drops the hit to the deepest snapshot at or before ``j``; removing the
    snapshot at ``p_i`` drops hits there to the previous snapshot.

    Returns:
        ``(per_block, per_snapshot)``: tokens for each block ``0..n_blocks-1``
        and for each snapshot position.
    """
    positions = sorted({p for p in snapshot_at if 1 <= p <= n_blocks})
    best = positions[-1] if positions else 0
    per_block = [0] * n_blocks
    per_snapshot: dict[int, int] = {}
    prev, idx = 0, 0
    for j in range(n_blocks):
        # deepest snapshot at or before block j (position <= j)
        while idx < len(positions) and positions[idx] <= j:
            prev = positions[idx]
            idx += 1
        per_block[j] = max(0, best - prev) * block_size if j < best else 0
    prev = 0
    for p in positions:
        per_snapshot[p] = (p - prev) * block_size
        prev = p
    return per_block, per_snapshot


class BranchTracker:
    """First child seen after each block: enough of a prefix tree to find branch points.

    Marconi admits a snapshot where a new sequence leaves a path the cache has
    seen (a branch point of the radix tree). A request that merely extends
    an earlier sequence (the next turn of a session) has no branch point.
    """

    def __init__(self) -> None:
        self._child: dict[str, str] = {}

    def observe(self, chain: Sequence[str], first: int = 0, upto: int | None = None) -> None:
        """Record the parent -> child links of blocks ``first..upto-1`` of ``chain``."""
        upto = len(chain) if upto is None else upto
        for j in range(max(1, first), upto):
            self._child.setdefault(chain[j - 1], chain[j])

    def branch_point(self, chain: Sequence[str], limit: int) -> int | None:
        """Position (in blocks, < ``limit``) where ``chain`` leaves a seen path, or None."""
        for j in range(1, min(limit, len(chain))):
            first = self._child.get(chain[j - 1])
            if first is None:
                return None
            if first != chain[j]:
                return j
        return None


ROOT = "root"  # the parent of a tail inside a request's first block


def tail_hash(parent: str, tokens: Sequence[int], extra: object = None) -> str:
    """Name of the state after ``tokens`` (fewer than a block) past the block ``parent`` ends.

    ``parent`` is the hash of the last full block before the tail (:data:`ROOT`
    in the first block); ``extra`` is what else keys those tokens (vLLM's
    per-block extra keys: LoRA, cache salt), so tenants never share a tail.
    """
    digest = hashlib.sha256(f"{parent}|{extra!r}|".encode())
    digest.update(array("q", tokens).tobytes())
    return digest.hexdigest()[:40]


class TailIndex:
    """Tails (states at an exact, not block-aligned, position) by the full block they follow.

    A request's longest tail hit is found by walking its full blocks and, at
    each depth, trying only the tail lengths stored under that block's hash,
    so a lookup hashes a few candidates, never every position. Entries are
    names only; the tiers say whether the items still exist.
    """

    def __init__(self) -> None:
        self._by_parent: dict[str, dict[int, str]] = {}
        self._owner: dict[str, tuple[str, int]] = {}  # tail hash -> (parent, length)

    def __len__(self) -> int:
        return len(self._owner)

    def add(self, parent: str, length: int, name: str) -> None:
        self._by_parent.setdefault(parent, {})[length] = name
        self._owner[name] = (parent, length)

    def lengths(self, parent: str) -> list[int]:
        """Tail lengths stored after ``parent``, longest first."""
        return sorted(self._by_parent.get(parent, ()), reverse=True)

    def discard(self, name: str) -> None:
        owner = self._owner.pop(name, None)
        if owner is None:
            return
        entries = self._by_parent.get(owner[0], {})
        if entries.get(owner[1]) == name:
            del entries[owner[1]]
        if not entries:
            self._by_parent.pop(owner[0], None)
