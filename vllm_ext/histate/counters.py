"""HiState counters (published as ``vllm_ext:histate_<name>_total`` by the connector)."""

from __future__ import annotations

from vllm_ext.common.counters import Counters, CounterSpec

SYSTEM = "histate"
COUNTER_SPECS = (
    CounterSpec("ssd_writes", "snapshot files written and made durable"),
    CounterSpec("ssd_write_bytes", "payload bytes written to the SSD tier"),
    CounterSpec("ssd_write_failures", "SSD writes that failed (disk full, EIO, ...); not stored"),
    CounterSpec("ssd_disk_full", "SSD writes refused with ENOSPC; the SSD tier shrank to what fit"),
    CounterSpec(
        "ssd_capacity_shrunk_bytes", "bytes the effective SSD capacity was lowered after ENOSPC"
    ),
    CounterSpec("ssd_reads", "snapshot files read and verified"),
    CounterSpec("ssd_read_bytes", "payload bytes read from the SSD tier"),
    CounterSpec("ssd_read_failures", "SSD reads that failed with an I/O error; treated as misses"),
    CounterSpec("ssd_corrupt", "torn, corrupt or foreign snapshot files found and quarantined"),
    CounterSpec("ssd_stale_temp_removed", "temporary files of interrupted writes removed"),
    CounterSpec(
        "ssd_foreign_files",
        "snapshot files of other namespaces (model, layout, weights) found at start; never read",
    ),
    CounterSpec(
        "ssd_superseded_removed",
        "snapshot files of the same model and layout with other weights removed at start",
    ),
    CounterSpec("host_hits", "snapshots or KV blocks served from host memory"),
    CounterSpec("ssd_hits", "snapshots served from the SSD tier"),
    CounterSpec("host_evictions", "items evicted from host memory"),
    CounterSpec("ssd_evictions", "snapshots evicted from the SSD tier"),
    CounterSpec("spills", "snapshots moved from host memory to the SSD tier"),
    CounterSpec("store_rejected", "stores refused: not admitted, or no room (all pinned)"),
)


def new_counters() -> Counters:
    """A fresh set of HiState counters."""
    return Counters(SYSTEM, COUNTER_SPECS)
