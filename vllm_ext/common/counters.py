"""Named monotonic counters a system keeps in whichever process it runs in.

A system declares its counters once (:class:`CounterSpec`), increments them in
its own code, and the vLLM adapter (:mod:`vllm_ext.common.prom`) drains the
increments each step and ships them to the API server, where they become
Prometheus counters on ``/metrics``. Pure Python, importable without vLLM.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable
from dataclasses import dataclass

_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


@dataclass(frozen=True)
class CounterSpec:
    """One counter: ``name`` (snake_case, no ``_total``) and its help text."""

    name: str
    doc: str

    def __post_init__(self) -> None:
        if not _NAME.match(self.name) or self.name.endswith("_total"):
            raise ValueError(f"counter name {self.name!r} must be snake_case without '_total'")


class Counters:
    """Thread-safe counters with pending increments drained by the publisher."""

    def __init__(self, system: str, specs: Iterable[CounterSpec]):
        self.system = system
        self.specs = tuple(specs)
        names = [spec.name for spec in self.specs]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate counter names in {names}")
        self._totals = dict.fromkeys(names, 0.0)
        self._pending = dict.fromkeys(names, 0.0)
        self._lock = threading.Lock()

    def inc(self, name: str, amount: float = 1.0) -> None:
        """Add ``amount`` (≥ 0) to counter ``name``."""
        if amount < 0:
            raise ValueError(f"counter {name!r} cannot decrease (amount={amount})")
        with self._lock:
            if name not in self._totals:
                allowed = ", ".join(self._totals)
                raise KeyError(f"unknown counter {name!r} for {self.system}; declared: {allowed}")
            self._totals[name] += amount
            self._pending[name] += amount

    def value(self, name: str) -> float:
        """Total of ``name`` since this object was created."""
        with self._lock:
            return self._totals[name]

    def drain(self) -> dict[str, float]:
        """Return the increments since the last drain (non-zero only) and clear them."""
        with self._lock:
            out = {name: amount for name, amount in self._pending.items() if amount}
            self._pending = dict.fromkeys(self._pending, 0.0)
        return out
