"""What HiStateConnector's two halves exchange, and the cache layout it checks (vLLM 0.32).

``HiStateMetadata`` (extends ``KVConnectorMetadata``) carries one step's loads
and stores from the scheduler to the worker; ``HiStateWorkerMetadata``
(extends ``KVConnectorWorkerMetadata``) carries stored payloads and failed
keys back. :func:`cache_layout` finds the attention and recurrent KV-cache
groups; :func:`cache_namespace` names everything that changes the bytes of a
page, so a snapshot file from another model or layout is a miss.
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


@dataclass
class LoadJob:
    """Copy these payloads into these blocks before the forward."""

    req_id: str
    kv: list[tuple[int, bytes]]  # (attention-group block id, KV payload)
    # the block vLLM caches the boundary state in, and the request's running-state block
    snapshot_blocks: tuple[int, ...]
    snapshot: bytes


@dataclass
class HiStateMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    # (key, KV-cache group id, block id) to copy out after the forward
    stores: list[tuple[str, int, int]] = field(default_factory=list)


@dataclass
class HiStateWorkerMetadata(KVConnectorWorkerMetadata):
    payloads: dict[str, bytes] = field(default_factory=dict)
    failed: list[str] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        # one worker only (checked at start); merging keeps the API contract
        if isinstance(other, HiStateWorkerMetadata):
            for key, payload in other.payloads.items():
                self.payloads.setdefault(key, payload)
            self.failed.extend(k for k in other.failed if k not in self.failed)
        return self


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


def cache_namespace(vllm_config, kv_cache_config) -> str:
    """Everything that changes the bytes of a page: a foreign file is a miss, never a hit."""
    model = vllm_config.model_config
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
            "weights": weights_fingerprint(model.model),
            "dtype": str(model.dtype),
            "cache_dtype": vllm_config.cache_config.cache_dtype,
            "groups": layout,
            "tp": par.tensor_parallel_size,
            "pp": par.pipeline_parallel_size,
        },
        sort_keys=True,
    )
