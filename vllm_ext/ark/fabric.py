"""Transfers and the leaf-spine fabric they cross (pure Python).

A :class:`Transfer` is one KV flow as senders announce it: who sends how many
bytes to whom, over which ports, in which expected time window. A
:class:`Fabric` knows which leaf every host hangs off; the spine a flow takes
is not a property of the fabric but of the path oracle (:mod:`.paths`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Transfer:
    """One KV transfer: ``nbytes`` from ``src:port`` to ``dst:dst_port`` during [start, end]."""

    transfer_id: str
    src: str
    dst: str
    nbytes: int
    start: float
    end: float
    port: int
    dst_port: int = 0
    # the spine the sender expects (from its own probes); None: ask the path oracle
    spine: int | None = None

    def __post_init__(self) -> None:
        if not self.transfer_id:
            raise ValueError("transfer_id must be non-empty")
        if self.nbytes < 0:
            raise ValueError(f"transfer {self.transfer_id}: nbytes {self.nbytes} < 0")
        if not self.end >= self.start:
            raise ValueError(f"transfer {self.transfer_id}: end {self.end} < start {self.start}")
        for name in ("port", "dst_port"):
            value = getattr(self, name)
            if not 0 <= value <= 65535:
                raise ValueError(f"transfer {self.transfer_id}: {name} {value} not in 0..65535")

    def with_port(self, port: int) -> Transfer:
        return dataclasses.replace(self, port=port)

    def overlap_bytes(self, start: float, end: float) -> float:
        """Bytes of this transfer expected inside [start, end], spread evenly over its window."""
        lo, hi = max(self.start, start), min(self.end, end)
        if hi < lo:
            return 0.0
        span = self.end - self.start
        if span <= 0:
            return float(self.nbytes)
        return self.nbytes * (hi - lo) / span


@dataclass(frozen=True)
class Fabric:
    """A two-tier leaf-spine: ``leaf_of[host]`` is the host's leaf; ``n_spines`` spines."""

    leaf_of: Mapping[str, int]
    n_spines: int

    def __post_init__(self) -> None:
        if self.n_spines < 1:
            raise ValueError(f"n_spines must be >= 1, got {self.n_spines}")

    def leaf(self, host: str) -> int | None:
        return self.leaf_of.get(host)

    @classmethod
    def uniform(cls, n_leaves: int, hosts_per_leaf: int, n_spines: int) -> Fabric:
        """Hosts ``h<leaf>_<i>``; useful for the simulator and tests."""
        leaf_of = {
            host_name(leaf, i): leaf for leaf in range(n_leaves) for i in range(hosts_per_leaf)
        }
        return cls(leaf_of=leaf_of, n_spines=n_spines)


def host_name(leaf: int, index: int) -> str:
    return f"h{leaf}_{index}"
