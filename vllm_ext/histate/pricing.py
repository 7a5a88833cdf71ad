"""What each item of one request's chain is worth: the recompute its loss causes (no vLLM).

A KV block is useful only while every block before it is cached and a snapshot
lies at or after it; so its loss is what a hit through it loses, which depends on
the whole chain, not on the request that first stored it. Items are re-priced from
the chain each time a request stores into it (:func:`chain_prices`), so a prefix
block is never priced below a block that depends on it.

Why (issue 36 part 3): the connector priced a KV block once, at its first store,
by that request's prompt, and never again. In a multi-turn session the early
blocks kept the small loss of an early turn while later turns stored their
descendants at larger losses; GreedyDual then evicted interior blocks and kept
the blocks after them, which no hit can use (twice LRU's share of such dead KV
in the host tier), and HiState recomputed more than LRU on engine-sized traces
(``InstanceSim(..., connector_v1=True)`` reproduces it; tests in
tests/unit/test_histate_pricing.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from vllm_ext.histate.lookup import recompute_tokens
from vllm_ext.histate.policy import kv_key, snap_key


def chain_prices(
    chain: Sequence[str], upto: int, block_size: int, snapshot_at: Iterable[int]
) -> list[tuple[str, int, int]]:
    """``(key, recompute_tokens, position)`` of every KV block and snapshot of ``chain[:upto]``.

    Args:
        chain: the request's block hashes (hex), in order.
        upto: blocks of the chain the request has computed.
        block_size: tokens per block.
        snapshot_at: positions (in blocks, 1..upto) holding a snapshot: held in a tier
            or being stored now.

    Returns:
        KV blocks first (block ``j``'s item ends at token ``(j + 1) * block_size``), then
        the snapshots, each with the extra tokens a future hit loses without it
        (:func:`~vllm_ext.histate.lookup.recompute_tokens`).
    """
    upto = min(upto, len(chain))
    per_block, per_snapshot = recompute_tokens(upto, list(snapshot_at), block_size)
    prices = [(kv_key(chain[j]), per_block[j], (j + 1) * block_size) for j in range(upto)]
    prices += [(snap_key(chain[p - 1]), tokens, p * block_size)
               for p, tokens in sorted(per_snapshot.items())]  # fmt: skip
    return prices


def held_snapshot_positions(
    chain: Sequence[str], upto: int, held: Callable[[str], bool]
) -> list[int]:
    """Positions (blocks, 1..upto) whose snapshot key ``held`` reports present."""
    return [p for p in range(1, min(upto, len(chain)) + 1) if held(snap_key(chain[p - 1]))]


__all__ = ["chain_prices", "held_snapshot_positions"]
