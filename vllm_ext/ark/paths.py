"""Path oracles: which spine a 5-tuple takes (pure Python).

The planner never assumes a switch hash. It asks an oracle:

- :class:`HashModel` is a *model* of a switch hash (CRC32 or an XOR fold over
  the 5-tuple, with a seed, modulo the spine count). The simulator uses it as
  the fabric itself, so ARK there knows the hash exactly; a real fabric's hash
  and seed are vendor-specific and undocumented.
- :class:`LearnedMap` is what a real deployment uses: a table of
  ``(src, dst, sport, dport) -> spine`` filled by probing each candidate port
  (a Paris-traceroute-style TTL-limited SYN, ``ip route get`` on a Linux
  router, or per-spine counters) and looked up afterwards. Unprobed tuples
  are unknown (``None``); the planner never guesses them.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Protocol

TCP = 6
Probe = Callable[[str, str, int, int], "int | None"]


class PathOracle(Protocol):
    def spine(self, src: str, dst: str, sport: int, dport: int) -> int | None:
        """Spine index the flow takes, or None when unknown."""


class HashModel:
    """``hash(seed, src, dst, proto, sport, dport) mod n_spines``."""

    FUNCTIONS = ("crc32", "xorfold")

    def __init__(self, n_spines: int, seed: int = 0, function: str = "crc32"):
        if n_spines < 1:
            raise ValueError(f"n_spines must be >= 1, got {n_spines}")
        if function not in self.FUNCTIONS:
            raise ValueError(f"unknown hash function {function!r}; one of {self.FUNCTIONS}")
        self.n_spines = n_spines
        self.seed = seed & 0xFFFFFFFF
        self.function = function
        self._hosts: dict[str, int] = {}

    def _host_key(self, host: str) -> int:
        key = self._hosts.get(host)
        if key is None:
            key = self._hosts[host] = zlib.crc32(host.encode())
        return key

    def spine(self, src: str, dst: str, sport: int, dport: int) -> int:
        a, b = self._host_key(src), self._host_key(dst)
        if self.function == "crc32":
            packed = struct.pack("!IIIBHH", self.seed, a, b, TCP, sport, dport)
            value = zlib.crc32(packed)
        else:
            value = self.seed ^ a ^ b ^ TCP ^ (sport << 16 | dport)
            value ^= value >> 16
            value ^= value >> 8
        return value % self.n_spines


class LearnedMap:
    """Spines of probed 5-tuples; unknown tuples stay unknown."""

    def __init__(self, entries: dict[tuple[str, str, int, int], int] | None = None):
        self._spines: dict[tuple[str, str, int, int], int] = dict(entries or {})

    def __len__(self) -> int:
        return len(self._spines)

    def spine(self, src: str, dst: str, sport: int, dport: int) -> int | None:
        return self._spines.get((src, dst, sport, dport))

    def record(self, src: str, dst: str, sport: int, dport: int, spine: int) -> None:
        if spine < 0:
            raise ValueError(f"spine index must be >= 0, got {spine}")
        self._spines[(src, dst, sport, dport)] = spine

    def forget(self, src: str, dst: str) -> None:
        """Drop every entry of a host pair (paths changed, e.g. a link went down)."""
        for key in [k for k in self._spines if k[0] == src and k[1] == dst]:
            del self._spines[key]

    def learn(self, probe: Probe, src: str, dst: str, dport: int, ports: Iterable[int]) -> int:
        """Probe each source port towards ``dst:dport``; returns how many were learned."""
        learned = 0
        for sport in ports:
            spine = probe(src, dst, sport, dport)
            if spine is not None:
                self.record(src, dst, sport, dport, spine)
                learned += 1
        return learned

    def spines_of(self, src: str, dst: str, dport: int) -> dict[int, int]:
        """``{sport: spine}`` known for one destination."""
        return {k[2]: s for k, s in self._spines.items() if k[:2] == (src, dst) and k[3] == dport}

    def to_json(self) -> str:
        rows = [[*key, spine] for key, spine in sorted(self._spines.items())]
        return json.dumps({"version": 1, "entries": rows})

    @classmethod
    def from_json(cls, text: str) -> LearnedMap:
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("version") != 1:
            raise ValueError("not an ARK path map (expected {'version': 1, 'entries': [...]})")
        entries = {}
        for row in data["entries"]:
            src, dst, sport, dport, spine = row
            entries[(str(src), str(dst), int(sport), int(dport))] = int(spine)
        return cls(entries)

    def save(self, path: str | os.PathLike[str]) -> Path:
        out = Path(path)
        tmp = out.with_suffix(out.suffix + ".tmp")
        tmp.write_text(self.to_json(), encoding="utf-8")
        tmp.replace(out)
        return out

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> LearnedMap:
        return cls.from_json(Path(path).read_text(encoding="utf-8"))


def save_fabric_file(path: str | os.PathLike[str], leaf_of: dict[str, int], n_spines: int,
                     paths: LearnedMap) -> Path:  # fmt: skip
    """One JSON file with the host-to-leaf map and the probed paths (``fabric_file``)."""
    data = json.loads(paths.to_json())
    data.update(leaf_of=dict(leaf_of), n_spines=int(n_spines))
    out = Path(path)
    out.write_text(json.dumps(data), encoding="utf-8")
    return out


def load_fabric_file(path: str | os.PathLike[str]):
    """``(Fabric, LearnedMap)`` from a file written by :func:`save_fabric_file`."""
    from vllm_ext.ark.fabric import Fabric

    text = Path(path).read_text(encoding="utf-8")
    data = json.loads(text)
    try:
        fabric = Fabric({str(k): int(v) for k, v in data["leaf_of"].items()}, int(data["n_spines"]))
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{path}: not an ARK fabric file (needs leaf_of and n_spines)") from exc
    return fabric, LearnedMap.from_json(text)
