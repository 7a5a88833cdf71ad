"""What HiStateConnector's two halves exchange, and the cache layout it checks (vLLM 0.32).

Ids and sizes only, never a page: the scheduler keeps the index and the
policy, the worker keeps the bytes (host tensors, SSD files).
``HiStateMetadata`` (extends ``KVConnectorMetadata``) carries one step's
tier operations, loads and stores to the worker, which applies them in that
order; ``HiStateWorkerMetadata`` (extends ``KVConnectorWorkerMetadata``)
carries back what happened: keys stored (with their sizes), stores that
failed, SSD reads staged or failed, spills the disk refused.
:func:`cache_layout` finds the attention and recurrent KV-cache groups;
:func:`cache_namespace` names everything that changes the bytes of a page, so
a snapshot file from another model or layout is a miss.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)
from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec

from vllm_ext.common.config import ConfigError
from vllm_ext.histate.fingerprint import weights_fingerprint
from vllm_ext.histate.worker_store import DROP, SPILL, STAGE, UNSTAGE, LoadJob

__all__ = ["DROP", "SPILL", "STAGE", "UNSTAGE", "HiStateMetadata", "HiStateWorkerMetadata",
           "LoadJob", "cache_layout", "cache_namespace"]  # fmt: skip


@dataclass
class HiStateMetadata(KVConnectorMetadata):
    # (DROP | SPILL, key, "") or (STAGE | UNSTAGE, key, stage id), applied first, in order
    ops: list[tuple[str, str, str]] = field(default_factory=list)
    loads: list[LoadJob] = field(default_factory=list)
    # (key, KV-cache group id, block id) to copy out after the forward
    stores: list[tuple[str, int, int]] = field(default_factory=list)
    # finished requests' tails (key, group id, block id): their blocks are held until copied
    final_stores: list[tuple[str, int, int]] = field(default_factory=list)
    releases: list[str] = field(default_factory=list)  # request ids whose blocks may go then


@dataclass
class HiStateWorkerMetadata(KVConnectorWorkerMetadata):
    stored: dict[str, int] = field(default_factory=dict)  # key -> bytes now on the host
    failed: list[str] = field(default_factory=list)  # stores that did not happen
    staged: list[tuple[str, str]] = field(default_factory=list)  # (stage id, key) read
    stage_failed: list[tuple[str, str]] = field(default_factory=list)  # unreadable: gone
    spill_failed: list[tuple[str, int, int]] = field(default_factory=list)  # key, errno, bytes

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        # one worker only (checked at start); merging keeps the API contract
        if isinstance(other, HiStateWorkerMetadata):
            for key, nbytes in other.stored.items():
                self.stored.setdefault(key, nbytes)
            for name in ("failed", "staged", "stage_failed", "spill_failed"):
                mine = getattr(self, name)
                mine.extend(x for x in getattr(other, name) if x not in mine)
        return self

    def is_empty(self) -> bool:
        return not (
            self.stored or self.failed or self.staged or self.stage_failed or self.spill_failed
        )


def cache_layout(kv_cache_config) -> tuple[int, int, dict[int, list[str]]]:
    """(attention group id, Mamba group id, group id -> layer names)."""
    attn, mamba, groups = [], [], {}
    for gid, group in enumerate(kv_cache_config.kv_cache_groups):
        groups[gid] = list(group.layer_names)
        if isinstance(group.kv_cache_spec, MambaSpec):
            mamba.append(gid)
        elif isinstance(group.kv_cache_spec, AttentionSpec):
            attn.append(gid)
    if len(attn) != 1 or len(mamba) != 1:
        raise ConfigError(
            "HiStateConnector needs a hybrid model with one attention and one recurrent "
            f"(Mamba/GDN) KV-cache group; found {len(attn)} attention and {len(mamba)} "
            "recurrent groups"
        )
    return attn[0], mamba[0], groups


def cache_namespace(vllm_config, kv_cache_config, digest_dir: str | None = None) -> str:
    """Everything that changes the bytes of a page: a foreign file is a miss, never a hit.

    ``digest_dir`` keeps the weight files' digests across restarts (the SSD
    folder), so an unchanged checkpoint is not read again
    (:mod:`vllm_ext.histate.fingerprint`).
    """
    model = vllm_config.model_config
    weights = weights_fingerprint(
        model.model, revision=model.revision, cache_dir=digest_dir,
        hub_cache_dir=getattr(vllm_config.load_config, "download_dir", None),
    )  # fmt: skip
    par = vllm_config.parallel_config
    layout = [
        {
            "spec": type(g.kv_cache_spec).__name__,
            "layers": sorted(g.layer_names),
            "block_size": g.kv_cache_spec.block_size,
            "page_bytes": g.kv_cache_spec.page_size_bytes,
        }
        for g in kv_cache_config.kv_cache_groups
    ]
    return json.dumps(
        {
            "model": model.model,
            "revision": model.revision,
            # the same path with other weights must be another namespace
            "weights": weights,
            "dtype": str(model.dtype),
            "cache_dtype": vllm_config.cache_config.cache_dtype,
            "groups": layout,
            "tp": par.tensor_parallel_size,
            "pp": par.pipeline_parallel_size,
        },
        sort_keys=True,
    )
