"""HiState configuration: one frozen dataclass, built by ``load_histate_config(...)``.

Users set it as ``--additional-config '{"histate": {...}}'`` (the tiers' sizes,
the SSD folder, the policy, fsync; the cost model's constants and ablation
switches inside ``"experimental"``), read in the scheduler and the worker
alike; ``kv_connector_extra_config`` is no longer read (an error says where a
key moved). Every field can also be set as ``VLLMEXT_HISTATE_<FIELD>``;
precedence is the block > environment > default. Values are checked in
``__post_init__``, so a directly constructed ``HiStateConfig`` is held to the
same rules as a loaded one.

Time and tokens on one scale (our design choice; the paper does not publish
its normalisation): an item's value is the seconds a future hit loses if it
leaves its tier, per MiB it frees. A KV block, or a snapshot leaving its last
tier, loses the prefill of the extra tokens recomputed (calibration
``prefill_s_per_token`` + a quadratic attention term ``prefill_s_per_token2``);
a snapshot that spills from host memory to the SSD loses only one SSD read
(``ssd_read_latency_s`` + bytes / ``ssd_read_bytes_per_s``). Time is the
queue's GreedyDual clock, which rises to the score of each evicted item, so
the score is ``clock at last access + w * loss / MiB`` in one unit (seconds of
loss per MiB) and does not depend on when the server started. ``time_weight =
0`` is plain recency (LRU on that clock); any ``w > 0`` yields the same order
(GreedyDual is scale-free), so ``w`` is the ablation's on/off switch rather
than a tuning knob.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal

from vllm_ext.common.config import ConfigError, config_block, load_config, option

SYSTEM = "histate"
POLICIES = ("lru", "marconi", "histate")
GIB = 1 << 30


@dataclass(frozen=True)
class HiStateConfig:
    """Settings of the HiState tiers, eviction queue and snapshot admission."""

    host_bytes: int = option(32 * GIB, doc="host-memory tier capacity, KV + snapshots (>= 0)")
    ssd_bytes: int = option(
        256 * GIB,
        doc="SSD tier capacity, snapshots only (>= 0; 0 = no SSD tier); capped at start by the "
        "free space on the folder's disk (plus what the folder holds), logged",
    )
    directory: str | None = option(
        None,
        doc="SSD tier folder (created if missing; '~' expands); None = the user cache folder, "
        "$XDG_CACHE_HOME/vllm_ext/histate (else ~/.cache/vllm_ext/histate)",
    )
    policy: Literal["lru", "marconi", "histate"] = option(
        "histate",
        doc="eviction/admission policy of the host and SSD tiers (lru and marconi: baselines)",
    )
    fsync: bool = option(True, doc="fsync snapshot files and the folder before they count")
    shared_group: bool = option(
        False,
        doc="SSD folder shared by one group: folders 0750 and files 0640 (else 0700/0600), "
        "and folders writable by, or owned by another member of, a group we are in are accepted",
    )
    allow_unsafe_directory: bool = option(
        False,
        doc="start with an SSD folder that other users could write (owned by another user, "
        "writable by group or world) with a warning instead of refusing: they could plant states",
    )
    time_weight: float = option(
        1.0,
        experimental=True,
        doc="w: weight of the loss (seconds per MiB) against the recency clock; 0 = LRU, "
        "every w > 0 gives the same order (>= 0)",
    )
    prefill_s_per_token: float = option(
        4.0e-5, experimental=True, doc="calibrated prefill seconds per token (linear part, > 0)"
    )
    prefill_s_per_token2: float = option(
        2.6e-10,
        experimental=True,
        doc="quadratic attention term: seconds per token per context token (>= 0)",
    )
    ssd_read_bytes_per_s: float = option(
        6.5e9,
        experimental=True,
        doc="SSD read bandwidth, prices a snapshot spilled from host memory (> 0)",
    )
    ssd_read_latency_s: float = option(
        1.0e-4,
        experimental=True,
        doc="SSD read latency per snapshot, prices a spilled snapshot (>= 0)",
    )
    marconi_alpha: float = option(
        1.0,
        experimental=True,
        doc="Marconi: weight of normalised FLOP efficiency against recency (>= 0)",
    )
    snapshot_interval_blocks: int = option(
        8, experimental=True, doc="histate/lru: keep a snapshot every N blocks of a prefix (>= 1)"
    )
    evict_slack: float = option(
        0.02,
        experimental=True,
        doc="when a tier is full, evict down to (1 - slack) x capacity, in [0, 0.5]",
    )
    spill_to_ssd: bool = option(
        True, experimental=True, doc="snapshots evicted from host memory go to the SSD"
    )
    release_device_snapshots: bool = option(
        True,
        experimental=True,
        doc="drop a snapshot's device copy when its block is freed and HiState holds it "
        "(device memory stays for KV; a later hit loads it from host/SSD)",
    )
    tail_snapshots: bool = option(
        True,
        experimental=True,
        doc="keep the state at each request's exact end with its partial last block's KV "
        "(the next turn of a conversation recomputes only its new tokens)",
    )

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ConfigError(
                f"HiStateConfig.policy must be one of {list(POLICIES)}, got {self.policy!r}"
            )
        for name in ("host_bytes", "ssd_bytes"):
            _check_int(name, getattr(self, name), minimum=0)
        _check_int("snapshot_interval_blocks", self.snapshot_interval_blocks, minimum=1)
        if self.directory is not None and (
            not isinstance(self.directory, str) or not self.directory
        ):
            raise ConfigError(
                f"HiStateConfig.directory must be a non-empty path or None, got {self.directory!r}"
            )
        if self.directory is not None:
            # "~/.cache/..." means the user's folder everywhere it is read (folder checks too)
            object.__setattr__(self, "directory", os.path.expanduser(self.directory))
        _check_float("time_weight", self.time_weight, lambda v: v >= 0, ">= 0")
        _check_float("prefill_s_per_token", self.prefill_s_per_token, lambda v: v > 0, "> 0")
        _check_float("prefill_s_per_token2", self.prefill_s_per_token2, lambda v: v >= 0, ">= 0")
        _check_float("ssd_read_bytes_per_s", self.ssd_read_bytes_per_s, lambda v: v > 0, "> 0")
        _check_float("ssd_read_latency_s", self.ssd_read_latency_s, lambda v: v >= 0, ">= 0")
        _check_float("marconi_alpha", self.marconi_alpha, lambda v: v >= 0, ">= 0")
        _check_float("evict_slack", self.evict_slack, lambda v: 0 <= v <= 0.5, "in [0, 0.5]")
        for name in (
            "spill_to_ssd", "fsync", "release_device_snapshots", "shared_group",
            "allow_unsafe_directory",
        ):  # fmt: skip
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(
                    f"HiStateConfig.{name} must be a boolean, got {getattr(self, name)!r}"
                )

    def recompute_seconds(self, tokens: int, end_position: int) -> float:
        """Prefill seconds to recompute ``tokens`` tokens ending at token ``end_position``.

        Linear part plus attention over the context: ``a * n + b * (end^2 - start^2) / 2``.
        """
        start = max(0, end_position - tokens)
        return self.prefill_s_per_token * tokens + self.prefill_s_per_token2 * 0.5 * (
            end_position * end_position - start * start
        )

    def ssd_read_seconds(self, nbytes: int) -> float:
        """Time to read ``nbytes`` of one snapshot back from the SSD tier."""
        return self.ssd_read_latency_s + nbytes / self.ssd_read_bytes_per_s


def load_histate_config(
    mapping: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None
) -> HiStateConfig:
    """``load_config(HiStateConfig, "histate", mapping, environ)``: block > env > defaults."""
    return load_config(HiStateConfig, SYSTEM, mapping, environ)


def reject_connector_extra_config(extra: Mapping[str, Any] | None) -> None:
    """HiState reads nothing from ``kv_connector_extra_config``: say where its keys moved."""
    if not extra:
        return
    known = {f.name for f in fields(HiStateConfig)}
    moved = {key: value for key, value in extra.items() if key in known}
    block = config_block(HiStateConfig, moved) if moved else {"...": "..."}
    raise ConfigError(
        f"HiStateConnector no longer reads kv_connector_extra_config (got {sorted(extra)}): "
        f"HiState settings moved to --additional-config '{json.dumps({SYSTEM: block})}'"
    )


def _check_int(name: str, value: Any, minimum: int) -> None:
    # bool is an int subclass; True as a byte count is a typo, not a value
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"HiStateConfig.{name} must be int, got {value!r}")
    if value < minimum:
        raise ConfigError(f"HiStateConfig.{name} must be >= {minimum}, got {value}")


def _check_float(name: str, value: Any, ok: Any, rule: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"HiStateConfig.{name} must be float, got {value!r}")
    # NaN fails every comparison, so `ok` alone would let some rules pass it
    if not math.isfinite(value) or not ok(value):
        raise ConfigError(f"HiStateConfig.{name} must be {rule}, got {value}")
