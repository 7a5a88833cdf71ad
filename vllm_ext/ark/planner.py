"""ARK's port planner: the candidate source port whose path is least loaded (pure Python).

For a new transfer ``T`` from leaf ``a`` to leaf ``b`` and each candidate
source port ``p``, the path oracle names the spine ``s(p)``. The cost of ``p``
is the load on the two fabric links ``T`` would share with other flows,
``uplink(a -> s)`` and ``downlink(s -> b)``: the announced bytes of other
transfers that cross that link *inside T's expected window* (each announced
transfer's bytes are spread evenly over its own window). The planner takes the
port with the smallest ``(max(up, down), up + down)``; ties are broken by a
hash of ``(transfer id, port)``, so two senders with the same view do not both
take the lowest port, and the same inputs always give the same port.

Transfers under ``min_bytes``, transfers inside one leaf (no spine to choose)
and transfers with no candidate of known path keep their current port; the
returned :class:`Choice` says which case applied. Cost: one pass over the
announcements plus one lookup per candidate, O(flows + candidates).
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from vllm_ext.ark.fabric import Fabric, Transfer
from vllm_ext.ark.paths import PathOracle

PLANNED, SMALL, LOCAL, UNKNOWN = "planned", "small", "local", "unknown_paths"


class _NoPaths:
    """An oracle that knows nothing: only announced spines count."""

    def spine(self, src: str, dst: str, sport: int, dport: int) -> None:
        return None


NO_PATHS = _NoPaths()


@dataclass(frozen=True)
class Choice:
    """The planner's answer: ``port`` (and its ``spine``), its cost, and why."""

    port: int
    spine: int | None
    cost: tuple[float, float]
    reason: str


def tie_break(transfer_id: str, port: int) -> int:
    return zlib.crc32(f"{transfer_id}/{port}".encode())


def spine_of(transfer: Transfer, oracle: PathOracle) -> int | None:
    """The announced spine if the sender gave one, else the oracle's."""
    if transfer.spine is not None:
        return transfer.spine
    return oracle.spine(transfer.src, transfer.dst, transfer.port, transfer.dst_port)


def link_loads(
    window: tuple[float, float],
    announced: Iterable[Transfer],
    fabric: Fabric,
    oracle: PathOracle,
    exclude: str | None = None,
) -> tuple[dict[tuple[int, int], float], dict[tuple[int, int], float]]:
    """Announced bytes in ``window`` per uplink ``(leaf, spine)``, downlink ``(spine, leaf)``."""
    up: dict[tuple[int, int], float] = {}
    down: dict[tuple[int, int], float] = {}
    for other in announced:
        if other.transfer_id == exclude:
            continue
        a, b = fabric.leaf(other.src), fabric.leaf(other.dst)
        if a is None or b is None or a == b:
            continue
        nbytes = other.overlap_bytes(*window)
        if nbytes <= 0:
            continue
        spine = spine_of(other, oracle)
        if spine is None:
            continue
        up[(a, spine)] = up.get((a, spine), 0.0) + nbytes
        down[(spine, b)] = down.get((spine, b), 0.0) + nbytes
    return up, down


def choose(
    transfer: Transfer,
    announced: Iterable[Transfer],
    fabric: Fabric,
    oracle: PathOracle,
    candidates: Sequence[int],
    *,
    min_bytes: int = 0,
) -> Choice:
    """Pick ``transfer``'s source port among ``candidates`` (see the module docstring)."""
    keep = Choice(transfer.port, None, (0.0, 0.0), SMALL)
    if transfer.nbytes < min_bytes:
        return keep
    a, b = fabric.leaf(transfer.src), fabric.leaf(transfer.dst)
    if a is None or b is None or a == b:
        return Choice(transfer.port, None, (0.0, 0.0), LOCAL)
    up, down = link_loads(
        (transfer.start, transfer.end), announced, fabric, oracle, transfer.transfer_id
    )
    best: tuple[tuple[float, float, int], int, int] | None = None
    for port in candidates:
        spine = oracle.spine(transfer.src, transfer.dst, port, transfer.dst_port)
        if spine is None:
            continue
        u, d = up.get((a, spine), 0.0), down.get((spine, b), 0.0)
        key = (max(u, d), u + d, tie_break(transfer.transfer_id, port))
        if best is None or key < best[0]:
            best = (key, port, spine)
    if best is None:
        return Choice(transfer.port, None, (0.0, 0.0), UNKNOWN)
    key, port, spine = best
    return Choice(port, spine, (key[0], key[1]), PLANNED)


def plan(
    transfer: Transfer,
    announced: Iterable[Transfer],
    fabric: Fabric,
    oracle: PathOracle,
    candidates: Sequence[int],
    *,
    min_bytes: int = 0,
) -> int:
    """The source port :func:`choose` picks."""
    return choose(transfer, announced, fabric, oracle, candidates, min_bytes=min_bytes).port


def offline_spines(transfers: Sequence[Transfer], fabric: Fabric) -> dict[str, int]:
    """Clairvoyant assignment: every transfer known up front, any spine allowed.

    Largest first, each transfer takes the spine minimising the same cost
    against all transfers already placed (longest-processing-time greedy);
    the simulator's and the testbed's "offline" baseline.
    """
    placed: list[Transfer] = []
    result: dict[str, int] = {}
    order = sorted(transfers, key=lambda t: (-t.nbytes, t.start, t.transfer_id))
    for transfer in order:
        a, b = fabric.leaf(transfer.src), fabric.leaf(transfer.dst)
        if a is None or b is None or a == b:
            continue
        up, down = link_loads((transfer.start, transfer.end), placed, fabric, NO_PATHS)
        costs = []
        for spine in range(fabric.n_spines):
            u, d = up.get((a, spine), 0.0), down.get((spine, b), 0.0)
            costs.append((max(u, d), u + d, tie_break(transfer.transfer_id, spine), spine))
        spine = min(costs)[3]
        result[transfer.transfer_id] = spine
        placed.append(dataclasses.replace(transfer, spine=spine))
    return result
