"""Count the Mamba block a KV-connector hit takes when vLLM admits it (align mode, vLLM 0.32).

In align mode (hybrid models with prefix caching) vLLM 0.32 under-counts the
blocks a request with connector (external) tokens takes from a Mamba group.
``MambaManager.get_num_blocks_to_allocate`` caps the new blocks at
``1 + partial + checkpoint`` (the running-state block), but
``allocate_external_computed_blocks`` first takes one block for the state at
the end of the external tokens (``cdiv(total, block_size)`` minus the
null-padded and local blocks). ``KVCacheManager.allocate_slots`` admits on
the short count, and ``BlockPool.get_new_blocks`` then raises "Cannot get 1
free blocks from the pool" when the pool is exactly full: the engine dies.

The patch wraps that method on the Mamba managers of one ``KVCacheManager``
(instance attributes; the vLLM class is untouched) so the count includes that
state block. It is an upper bound: one block too many only delays an
admission. Applied by ``HiStateConnector.bind_kv_cache_manager``.
"""

from __future__ import annotations

import inspect

from vllm_ext.common.compat import installed_vllm_version, parse_series
from vllm_ext.common.log import get_logger

logger = get_logger(__name__)

TARGET_SERIES = (0, 32)
_MARK = "vllm_ext_external_state_block"
# the parameters the wrap reads, in vLLM 0.32's order
_COUNT_PARAMS = (
    "request_id", "num_tokens", "new_computed_blocks", "total_computed_tokens",
    "num_local_computed_tokens",
)  # fmt: skip


def needed() -> bool:
    """True on vLLM 0.32 whose ``MambaManager`` count has the signature this patch knows."""
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager

    if parse_series(installed_vllm_version() or "") != TARGET_SERIES:
        return False
    params = tuple(inspect.signature(MambaManager.get_num_blocks_to_allocate).parameters)
    known = params[1 : 1 + len(_COUNT_PARAMS)] == _COUNT_PARAMS
    return known and hasattr(MambaManager, "get_num_skipped_tokens")


def _align_managers(kv_cache_manager) -> list:
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager

    return [
        m
        for m in kv_cache_manager.coordinator.single_type_managers
        if isinstance(m, MambaManager) and getattr(m, "mamba_cache_mode", None) == "align"
    ]


def _counting_external_state(manager, count):
    from vllm.utils.math_utils import cdiv

    def get_num_blocks_to_allocate(
        request_id, num_tokens, new_computed_blocks, total_computed_tokens,
        num_local_computed_tokens, *args, **kwargs,
    ) -> int:  # fmt: skip
        n = count(
            request_id, num_tokens, new_computed_blocks, total_computed_tokens,
            num_local_computed_tokens, *args, **kwargs,
        )  # fmt: skip
        if (
            total_computed_tokens <= num_local_computed_tokens
            or manager.req_to_blocks.get(request_id)
            or n > manager.block_pool.num_gpu_blocks  # vLLM's "not this step" sentinel
        ):
            return n
        # mirrors add_local_computed_blocks + allocate_external_computed_blocks: the
        # skipped states become nulls, then blocks up to the end of the external tokens
        skipped = manager.get_num_skipped_tokens(total_computed_tokens) // manager.block_size
        present = max(skipped, len(new_computed_blocks))
        return n + max(0, cdiv(total_computed_tokens, manager.block_size) - present)

    setattr(get_num_blocks_to_allocate, _MARK, count)
    return get_num_blocks_to_allocate


def is_applied(kv_cache_manager) -> bool:
    managers = _align_managers(kv_cache_manager)
    return bool(managers) and all(hasattr(m.get_num_blocks_to_allocate, _MARK) for m in managers)


def apply(kv_cache_manager) -> int:
    """Patch every align-mode Mamba manager of ``kv_cache_manager`` once; how many now.

    0 on another vLLM (with a warning) or when all are patched already.
    """
    if not needed():
        logger.warning(
            "vllm_ext: MambaManager.get_num_blocks_to_allocate is not vLLM 0.32's; "
            "connector hits are admitted on vLLM's own block count"
        )
        return 0
    patched = 0
    for manager in _align_managers(kv_cache_manager):
        count = manager.get_num_blocks_to_allocate
        if not hasattr(count, _MARK):
            manager.get_num_blocks_to_allocate = _counting_external_state(manager, count)
            patched += 1
    return patched


def revert(kv_cache_manager) -> None:
    for manager in _align_managers(kv_cache_manager):
        original = getattr(manager.get_num_blocks_to_allocate, _MARK, None)
        if original is not None:
            # the instance attribute shadowed the class method: dropping it restores it
            del manager.get_num_blocks_to_allocate
