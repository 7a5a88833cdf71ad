"""Planned ports for long-lived connections that carry KV *towards* us (NIXL pull, pure Python).

In NIXL's pull mode the decode side connects to the prefill side's UCX listener
and the KV flows back on that connection: from ``prefill:listener`` to
``decode:port``, where ``port`` is the one the decode side binds (through the
shim). The fabric hashes the KV packets' 5-tuple, so the port we pick is the
flow's *destination* port. :func:`plan_connections` runs the same planner as
per-transfer sending (:func:`vllm_ext.ark.planner.choose`) over the probed path
map of that direction, one connection at a time, each seeing the connections
already placed (with their spines) as load of equal weight: a pair's
connections (one per NIXL worker thread) and those to other peers spread over
the spines. A connection lives for the instance's life, so this is a choice
per connection, not per transfer. A port is given to one connection only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from vllm_ext.ark.fabric import Fabric, Transfer
from vllm_ext.ark.paths import PathOracle
from vllm_ext.ark.planner import PLANNED, choose

# connections are weighted equally: each is expected to carry a like share of the KV
_WEIGHT = 1 << 30


class _ChosenDestination:
    """An oracle view where the candidate is the destination port (the pull direction)."""

    def __init__(self, oracle: PathOracle):
        self.oracle = oracle

    def spine(self, src: str, dst: str, port: int, listener: int) -> int | None:
        return self.oracle.spine(src, dst, listener, port)


@dataclass
class ConnectionPlan:
    """The connections placed so far and the ports they hold on ``local``.

    ``placed`` may be shared by the plans of several receivers: each then sees the
    others' connections as load (ports are only exclusive per receiver).
    """

    local: str
    fabric: Fabric
    oracle: PathOracle
    candidates: Sequence[int]
    placed: list[Transfer] = field(default_factory=list)
    planned: int = 0  # connections whose port came from the path map
    kept: int = 0  # connections that got the next free port (paths unknown, same leaf)

    def ports(self, peer: str, listener: int, n: int) -> list[int]:
        """``n`` ports for connections ``peer:listener -> local:port``, planned in turn."""
        view = _ChosenDestination(self.oracle)
        out: list[int] = []
        for _ in range(n):
            taken = {t.port for t in self.placed if t.dst == self.local}
            free = [p for p in self.candidates if p not in taken]
            if not free:
                break
            conn = Transfer(f"{peer}:{listener}/{len(self.placed)}", peer, self.local, _WEIGHT,
                            0.0, 1.0, free[0], listener)  # fmt: skip
            choice = choose(conn, self.placed, self.fabric, view, free)
            self.planned += choice.reason == PLANNED
            self.kept += choice.reason != PLANNED
            self.placed.append(Transfer(conn.transfer_id, peer, self.local, _WEIGHT, 0.0, 1.0,
                                        choice.port, listener, choice.spine))  # fmt: skip
            out.append(choice.port)
        return out

    def spines(self) -> dict[int, int | None]:
        """``{port: spine}`` of the placed connections (None where the path is unknown)."""
        return {t.port: t.spine for t in self.placed}


class ListenerPlans:
    """One :class:`ConnectionPlan` per port of the prefill side's UCX listener range.

    The decode side learns a peer's listener port only when UCX connects, so it
    plans every port of the range (``UCX_TCP_PORT_RANGE`` of the prefill
    instances) and the shim picks the list of the port actually connected to.
    Peers that listen on the same port share that port's plan, so their
    connections are balanced against each other.
    """

    def __init__(self, local: str, fabric: Fabric, oracle: PathOracle,
                 candidates: Sequence[int], listeners: Sequence[int]) -> None:  # fmt: skip
        self.plans = {port: ConnectionPlan(local, fabric, oracle, candidates) for port in listeners}

    def ports(self, peer: str, n: int) -> dict[int, list[int]]:
        """``{listener port: n ports}`` for ``peer``'s connections."""
        return {listener: plan.ports(peer, listener, n) for listener, plan in self.plans.items()}

    def counts(self) -> tuple[int, int]:
        """(planned, kept) connections, over all listener ports."""
        plans = self.plans.values()
        return sum(p.planned for p in plans), sum(p.kept for p in plans)
