"""Swap: LEAP's scheduler and connector under vLLM's own scheduler tests.

``install()`` wraps ``tests.v1.core.utils.create_scheduler`` (before the test
modules import it). A test that leaves the class to the helper gets LEAP's
(sync or async, as the helper would pick vLLM's) and LEAP's connector:

- a test without a connector gets LEAP's alone (``kv_role`` as the test asks);
- a test with its own (ExampleConnector, a named one, vLLM's MockKVConnector)
  gets a MultiConnector of its connector first and LEAP's second, as a user
  composes them (``--kv-transfer-config`` with ``MultiConnector``): the test's
  connector still answers every KV question, LEAP's rides along.

Left stock: a test that picks its own ``scheduler_cls`` (it tests that class), and
one that picks the ``priority`` policy (LEAP replaces the queue order and refuses
it at start-up, by design).

The tests carry no length hint and LEAP has no predictor here, so LEAP must keep
vLLM's schedule exactly (its drop-in property) while its queues, its hooks and
its connector run. Each swapped scheduler also audits itself after every call
(:class:`Audited`): every queued or running request is known and in one place;
the queues' sizes agree with their contents; when idle, every KV block is free
exactly once and LEAP holds no per-request state.
"""

from __future__ import annotations

import inspect

LEAP_CONNECTOR = {
    "kv_connector": "LeapConnector",
    "kv_connector_module_path": "vllm_ext.leap.connector",
}


class AuditError(AssertionError):
    """An invariant of the scheduler's bookkeeping broke under LEAP."""


class Audited:
    """Checks the scheduler's books after each public call (cheap while busy)."""

    def schedule(self, *args, **kwargs):
        out = super().schedule(*args, **kwargs)
        self._audit()
        return out

    def update_from_output(self, *args, **kwargs):
        out = super().update_from_output(*args, **kwargs)
        self._audit()
        return out

    def finish_requests(self, *args, **kwargs):
        out = super().finish_requests(*args, **kwargs)
        self._audit()
        return out

    def _audit(self) -> None:
        queues = {"running": self.running, **{q: getattr(self, q) for q in _queue_names(self)}}
        seen: dict[str, str] = {}
        for name, queue in queues.items():
            members = list(queue)
            if len(members) != len(queue):
                raise AuditError(f"{name}: len {len(queue)} but {len(members)} requests")
            for request in members:
                rid = request.request_id
                if rid in seen:
                    raise AuditError(f"{rid} in both {seen[rid]} and {name}")
                seen[rid] = name
                if self.requests.get(rid) is not request:
                    raise AuditError(f"{rid} in {name} but not in scheduler.requests")
        if not self.requests:
            self._audit_idle()

    def _audit_idle(self) -> None:
        pool = self.kv_cache_manager.block_pool
        held = [b.block_id for b in pool.blocks if b.ref_cnt != 0 and not b.is_null]
        if held:
            raise AuditError(f"idle, yet blocks {held[:8]} are still referenced (leak)")
        negative = [b.block_id for b in pool.blocks if b.ref_cnt < 0]
        free = pool.free_block_queue.num_free_blocks
        if negative or free != pool.num_gpu_blocks - 1:  # the null block is never free
            raise AuditError(
                f"idle with {free} of {pool.num_gpu_blocks - 1} blocks free, "
                f"negative ref counts {negative[:8]} (double free)"
            )
        leftovers = {
            "columns": self._leap_columns,
            "loop checks": self._leap_loop_due,
            "runtime entries": self.leap._entries,
        }
        # requests finished since the last step are forgotten at the next schedule()
        pending = set(self.finished_req_ids)
        kept = {k: ids[:4] for k, v in leftovers.items() if (ids := sorted(set(v) - pending))}
        if kept:
            raise AuditError(f"idle, yet LEAP keeps per-request state: {kept}")


def _queue_names(scheduler) -> list[str]:
    names = ["waiting", "kv_holding_waiting", "async_kv_waiting"]
    return [n for n in names if hasattr(scheduler, n)]


def _scheduler_classes():
    from vllm_ext.leap.scheduler import LeapAsyncScheduler, LeapScheduler

    class AuditedLeapScheduler(Audited, LeapScheduler):
        pass

    class AuditedLeapAsyncScheduler(Audited, LeapAsyncScheduler):
        pass

    return AuditedLeapScheduler, AuditedLeapAsyncScheduler


def install() -> None:
    import tests.v1.core.utils as utils

    from vllm_ext.common import compat

    compat.register_connector_once("LeapConnector", "vllm_ext.leap.connector", "LeapConnector")
    original = utils.create_scheduler
    signature = inspect.signature(original)
    sync_cls, async_cls = _scheduler_classes()
    vllm_transfer_config = utils.KVTransferConfig

    def with_leap(**fields):
        """The helper's KVTransferConfig, with LEAP's connector added."""
        if fields.get("kv_connector") == "LeapConnector":
            return vllm_transfer_config(**fields, kv_connector_module_path=LEAP_CONNECTOR[
                "kv_connector_module_path"])  # fmt: skip
        role = fields.get("kv_role", "kv_both")
        return vllm_transfer_config(
            kv_connector="MultiConnector",
            kv_role=role,
            kv_connector_extra_config={"connectors": [fields, {**LEAP_CONNECTOR, "kv_role": role}]},
        )

    def create_scheduler(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        given = bound.arguments
        if given["scheduler_cls"] is not None or given["scheduling_policy"] != "fcfs":
            return original(*args, **kwargs)
        given["scheduler_cls"] = async_cls if given["async_scheduling"] else sync_cls
        if not given["use_kv_connector"]:
            given["use_kv_connector"] = "LeapConnector"
        utils.KVTransferConfig = with_leap
        try:
            return original(**given)
        finally:
            utils.KVTransferConfig = vllm_transfer_config

    utils.create_scheduler = create_scheduler
