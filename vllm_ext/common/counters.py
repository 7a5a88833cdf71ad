"""Named counters, gauges and histograms a system keeps in whichever process it runs in.

A system declares its metrics once (:class:`CounterSpec`, :class:`GaugeSpec`,
:class:`HistogramSpec`), updates them in its own code, and the vLLM adapter
(:mod:`vllm_ext.common.prom`) drains what changed each step and ships it to the
API server, where it becomes Prometheus metrics on ``/metrics``. Pure Python,
importable without vLLM.

What :meth:`Counters.drain` returns: ``{counter: increment}``, plus
``{"gauge:<name>" or "gauge:<name>:<label value>": latest value}`` and
``{"hist:<name>": [observations]}`` (prefixed keys: merged by their own rule).
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


@dataclass(frozen=True)
class GaugeSpec:
    """A value that goes up and down (``name`` in vLLM's style, e.g. ``tier_used_bytes``);
    ``label``: the name of one extra label whose values the system sets (e.g. ``tier``)."""

    name: str
    doc: str
    label: str | None = None

    def __post_init__(self) -> None:
        if not _NAME.match(self.name) or self.name.endswith("_total"):
            raise ValueError(f"gauge name {self.name!r} must be snake_case without '_total'")
        if self.label is not None and not _NAME.match(self.label):
            raise ValueError(f"gauge label {self.label!r} must be snake_case")


@dataclass(frozen=True)
class HistogramSpec:
    """A distribution of observations (``name`` with its unit, e.g. ``restore_seconds``)."""

    name: str
    doc: str
    buckets: tuple[float, ...]

    def __post_init__(self) -> None:
        if not _NAME.match(self.name) or self.name.endswith("_total"):
            raise ValueError(f"histogram name {self.name!r} must be snake_case without '_total'")
        if not self.buckets or list(self.buckets) != sorted(set(self.buckets)):
            raise ValueError(f"histogram {self.name!r}: buckets must be increasing")


GAUGE, HIST = "gauge:", "hist:"


class Counters:
    """Thread-safe counters (and gauges, histograms) with pending updates drained by the
    publisher."""

    def __init__(self, system: str, specs: Iterable[CounterSpec | GaugeSpec | HistogramSpec]):
        self.system = system
        self.specs = tuple(specs)
        names = [spec.name for spec in self.specs]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate metric names in {names}")
        counters = [spec.name for spec in self.specs if isinstance(spec, CounterSpec)]
        self._gauge_specs = {s.name: s for s in self.specs if isinstance(s, GaugeSpec)}
        self._hist_names = {s.name for s in self.specs if isinstance(s, HistogramSpec)}
        self._totals = dict.fromkeys(counters, 0.0)
        self._pending = dict.fromkeys(counters, 0.0)
        self._gauges: dict[str, float] = {}
        self._observed = dict.fromkeys(self._hist_names, 0)
        self._pending_other: dict[str, object] = {}
        self._lock = threading.Lock()

    def set(self, name: str, value: float, label: str | None = None) -> None:
        """Set gauge ``name`` (for the value ``label`` of its declared label) to ``value``."""
        spec = self._gauge_specs.get(name)
        if spec is None:
            raise KeyError(f"unknown gauge {name!r} for {self.system}")
        if (spec.label is None) != (label is None):
            raise ValueError(f"gauge {name!r} takes label {spec.label!r}, got {label!r}")
        key = GAUGE + name + ("" if label is None else ":" + label)
        with self._lock:
            if self._gauges.get(key) != value:  # only changes travel
                self._gauges[key] = value
                self._pending_other[key] = float(value)

    def gauge(self, name: str, label: str | None = None) -> float | None:
        """Latest value of a gauge (None: never set)."""
        with self._lock:
            return self._gauges.get(GAUGE + name + ("" if label is None else ":" + label))

    def observe(self, name: str, value: float) -> None:
        """Record one observation of histogram ``name``."""
        if name not in self._hist_names:
            raise KeyError(f"unknown histogram {name!r} for {self.system}")
        with self._lock:
            self._pending_other.setdefault(HIST + name, []).append(float(value))
            self._observed[name] += 1

    def observed(self, name: str) -> int:
        """Observations of histogram ``name`` since this object was created."""
        with self._lock:
            return self._observed[name]

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
            out.update(self._pending_other)
            self._pending_other = {}
        return out


def merge_updates(into: dict, other: dict) -> dict:
    """Merge drained updates: counters add, gauges keep the latest, observations append."""
    for key, value in other.items():
        if key.startswith(GAUGE):
            into[key] = value
        elif key.startswith(HIST):
            into[key] = [*into.get(key, ()), *value]
        else:
            into[key] = into.get(key, 0.0) + value
    return into
