"""What a sender does per transfer: plan from its view (or fall back), count, announce.

Shared by the vLLM connector and the testbed so both run the same steps.
Without a view (peers configured, none alive) the transfer gets a random
candidate port and ``fallback`` is counted: ARK then behaves like plain ECMP,
never worse and never blocked.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence

from vllm_ext.ark.announce import Announcer
from vllm_ext.ark.fabric import Fabric, Transfer
from vllm_ext.ark.paths import PathOracle
from vllm_ext.ark.planner import PLANNED, Choice, choose

FALLBACK = "fallback"


class PortSelector:
    """Plans one transfer's source port and announces the result."""

    def __init__(self, announcer: Announcer, fabric: Fabric, oracle: PathOracle,
                 min_bytes: int = 0, seed: int | None = None):  # fmt: skip
        self.announcer = announcer
        self.fabric = fabric
        self.oracle = oracle
        self.min_bytes = min_bytes
        self._rng = random.Random(seed)

    @property
    def counters(self):
        return self.announcer.counters

    def select(self, transfer: Transfer, candidates: Sequence[int]) -> Choice:
        """Choose ``transfer``'s port among ``candidates``, announce it, return the choice."""
        view = self.announcer.current_view()
        if view is None:
            port = self._rng.choice(list(candidates)) if candidates else transfer.port
            choice = Choice(port, None, (0.0, 0.0), FALLBACK)
            self.counters.inc("fallback")
        else:
            choice = choose(transfer, view, self.fabric, self.oracle, candidates,
                            min_bytes=self.min_bytes)  # fmt: skip
            self.counters.inc("planned" if choice.reason == PLANNED else "kept_port")
        spine = choice.spine
        if spine is None:
            spine = self.oracle.spine(transfer.src, transfer.dst, choice.port, transfer.dst_port)
        self.announcer.announce([dataclasses.replace(transfer, port=choice.port, spine=spine)])
        return choice
