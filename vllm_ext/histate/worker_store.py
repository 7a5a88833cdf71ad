"""The worker's half of HiState's tiers: the bytes (host tensors, SSD files) and the copies.

The scheduler keeps only the index and the policy
(:mod:`vllm_ext.histate.runtime`) and sends ids; :class:`WorkerStore` holds
what they name and does what they say, in the order of one step:

1. :meth:`WorkerStore.apply` (before the loads): ``drop`` a key (host copy
   and file), ``spill`` a host copy to its SSD file, ``stage`` a snapshot file
   into a staging buffer (a request's next hit loads from there), ``unstage``.
   SSD work runs on one I/O thread in submission order (so a delete never
   overtakes the write it follows, and a stage reads a spill's complete file),
   never on the step.
2. :meth:`WorkerStore.load`: host copies (and staged snapshots) into the pages,
   before the forward, as one batch of copies.
3. :meth:`WorkerStore.store` (after the forward): pages into host copies, one batch.

What happened comes back as :class:`Report` (keys and sizes only). A key the
scheduler plans a load of is always here: stores are reported only once
copied, drops come only from the scheduler, and an SSD snapshot is loaded only
after its stage was reported; a missing one is an internal error and raises
(a forward on a wrong state would decode wrong tokens). Host copies are uint8
tensors (pinned on CUDA, from :meth:`PageCopier.read_host`); only files hold bytes.
No vLLM types.
"""

from __future__ import annotations

import errno
import queue
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from vllm_ext.common.log import get_logger
from vllm_ext.histate.pages import PageCopier
from vllm_ext.histate.policy import snap_key, tail_snap_key
from vllm_ext.histate.snapfile import SnapshotStore

logger = get_logger(__name__)

DROP, SPILL, STAGE, UNSTAGE = "drop", "spill", "stage", "unstage"
_SNAPSHOT_PREFIX = snap_key("")
_TAIL_PREFIX = tail_snap_key("")


@dataclass
class LoadJob:
    """Copy these keys' host copies into these blocks before the forward."""

    req_id: str
    kv: list[tuple[int, str]]  # (attention-group block id, key)
    # the block vLLM caches the boundary state in, and the request's running-state block
    snapshot_blocks: tuple[int, ...]
    snapshot_key: str
    stage_id: str = ""  # the snapshot was read from the SSD into this staging buffer


@dataclass
class Report:
    """What the worker did since the last report (the fields of HiStateWorkerMetadata)."""

    stored: dict[str, int] = field(default_factory=dict)
    failed: list[str] = field(default_factory=list)
    staged: list[tuple[str, str]] = field(default_factory=list)
    stage_failed: list[tuple[str, str]] = field(default_factory=list)
    spill_failed: list[tuple[str, int, int]] = field(default_factory=list)  # key, errno, bytes


class WorkerStore:
    """Host copies, SSD files and page copies of one worker.

    Args:
        pages: the registered KV pages.
        ssd: the snapshot files; None = no SSD tier (spills fail, reported).
        attn_group, mamba_group: KV-cache group ids of KV blocks and snapshots.
    """

    def __init__(
        self, pages: PageCopier, ssd: SnapshotStore | None, attn_group: int, mamba_group: int
    ):
        self.pages = pages
        self.ssd = ssd
        self.attn_group = attn_group
        self.mamba_group = mamba_group
        self._host: dict[str, torch.Tensor] = {}
        # staging buffers, written by the I/O thread: stage id -> (key, host tensor)
        self._staged: dict[str, tuple[str, torch.Tensor]] = {}
        self._lock = threading.Lock()
        self._report = Report()
        self._closed = False
        self._io: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="histate-ssd", daemon=True)
        self._thread.start()

    def host_keys(self) -> set[str]:
        """Keys with a host copy (tests)."""
        return set(self._host)

    # ---- one step, in this order
    def apply(self, ops: Iterable[tuple[str, str, str]]) -> None:
        """Tier operations from the scheduler; SSD work is queued, never waited for."""
        for op, key, stage_id in ops:
            if op == DROP:
                self._host.pop(key, None)
                if self.ssd is not None and key.startswith(_SNAPSHOT_PREFIX):
                    # only snapshots have files; after a queued spill, in order
                    self._submit(lambda k=key: self.ssd.delete(k))
            elif op == SPILL:
                self._spill(key)
            elif op == STAGE:
                self._submit(lambda r=stage_id, k=key: self._stage(r, k))
            elif op == UNSTAGE:
                # queued: a stage still in flight lands first, then goes
                self._submit(lambda r=stage_id: self._unstage(r))
            else:
                raise ValueError(f"HiState: unknown tier operation {op!r}")

    def load(self, jobs: Iterable[LoadJob]) -> None:
        """Fill the planned blocks (one batch of copies); raises if a promised copy is missing."""
        writes: list[tuple[int, int, torch.Tensor]] = []
        for job in jobs:
            writes += [(self.attn_group, block, self._host_copy(key)) for block, key in job.kv]
            if job.stage_id:
                with self._lock:
                    key, state = self._staged.pop(job.stage_id, ("", None))
                if key != job.snapshot_key or state is None:
                    raise RuntimeError(
                        f"HiState: no staged copy of {job.snapshot_key} for {job.req_id} "
                        "(the scheduler's index and the worker's tiers diverged)"
                    )
            else:
                state = self._host_copy(job.snapshot_key)
            writes += [(self.mamba_group, block, state) for block in job.snapshot_blocks]
        if writes:
            self.pages.write_many(writes)

    def store(self, stores: Iterable[tuple[str, int, int]]) -> None:
        """Copy pages out after the forward (one batch); a failed copy is reported, never raised."""
        stores = list(stores)
        try:
            copies = self.pages.read_many([(group, block) for _, group, block in stores])
        except Exception:  # noqa: BLE001 - one bad block must not lose the batch: one by one
            copies = [self._read_one(key, group, block) for key, group, block in stores]
        for (key, _, _), copy in zip(stores, copies, strict=True):
            with self._lock:
                if copy is None:
                    self._report.failed.append(key)
                    continue
                self._host[key] = copy
                self._report.stored[key] = copy.numel()

    def _read_one(self, key: str, group_id: int, block_id: int) -> torch.Tensor | None:
        try:
            return self.pages.read_host(group_id, block_id)
        except Exception:  # noqa: BLE001 - a lost store is a future miss, never an error
            logger.exception("HiState: copying out %s (block %d) failed", key, block_id)
            return None

    def take_report(self) -> Report | None:
        """What happened since the last call; None if nothing did."""
        with self._lock:
            report, self._report = self._report, Report()
        return report if any(vars(report).values()) else None

    # ---- lifecycle
    def settle(self) -> None:
        """Wait until the queued SSD work is done (tests, shutdown)."""
        self._io.join()

    def close(self, persist: bool = True) -> None:
        """Finish SSD work; with ``persist``, write host snapshots to their files (a restart
        with the same folder and layout finds them). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._io.put(None)
        self._thread.join(timeout=60)
        if self.ssd is None:
            return
        if persist:
            written = 0
            for key, copy in list(self._host.items()):
                # a tail's partial KV block lives in host memory only: its state alone
                # could never be hit after a restart
                if key.startswith(_TAIL_PREFIX):
                    continue
                if key.startswith(_SNAPSHOT_PREFIX) and self.ssd.put(key, memoryview(copy.numpy())):
                    written += 1
            logger.info("HiState: persisted %d host snapshots to %s", written, self.ssd.root)
        self.ssd.close()

    # ---- SSD work (I/O thread)
    def _spill(self, key: str) -> None:
        copy = self._host.pop(key, None)
        if copy is None or self.ssd is None:
            code = errno.ENOENT if copy is None else errno.ENODEV
            with self._lock:
                self._report.spill_failed.append((key, code, 0 if copy is None else copy.numel()))
            return

        def write() -> None:
            try:
                # a host tensor (never a device one): .numpy() is a view of its bytes
                code = self.ssd.write(key, memoryview(copy.numpy()))
            except Exception:  # noqa: BLE001 - reported: the index must forget the key
                logger.exception("HiState: spilling %s failed", key)
                code = errno.EIO
            if code:
                with self._lock:
                    self._report.spill_failed.append((key, code, copy.numel()))

        self._submit(write)

    def _stage(self, stage_id: str, key: str) -> None:
        try:
            payload = self.ssd.get(key) if self.ssd is not None else None
            state = None if payload is None else self.pages.to_host(payload)
        except Exception:  # noqa: BLE001 - reported: the request falls back to a shorter hit
            logger.exception("HiState: staging %s failed", key)
            state = None
        with self._lock:
            if state is None:
                # corrupt files were quarantined and counted by the store
                self._report.stage_failed.append((stage_id, key))
            else:
                self._staged[stage_id] = (key, state)
                self._report.staged.append((stage_id, key))

    def _unstage(self, stage_id: str) -> None:
        with self._lock:
            self._staged.pop(stage_id, None)

    def _host_copy(self, key: str) -> torch.Tensor:
        copy = self._host.get(key)
        if copy is None:
            raise RuntimeError(
                f"HiState: no host copy of {key} on the worker "
                "(the scheduler's index and the worker's tiers diverged)"
            )
        return copy

    def _submit(self, work: Callable[[], None]) -> None:
        if self._closed:
            work()  # a step after close (engine teardown): still done, and reported
            return
        self._io.put(work)

    def _run(self) -> None:
        while True:
            work = self._io.get()
            try:
                if work is None:
                    return
                work()
            except Exception:  # noqa: BLE001 - SSD work is best effort; serving goes on
                logger.exception("HiState: SSD work failed")
            finally:
                self._io.task_done()
