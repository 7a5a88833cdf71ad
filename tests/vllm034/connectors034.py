"""Our KV connectors built from vLLM 0.34 configs, the way vLLM's own connector tests build theirs.

Configs and schedulers come from 0.34's ``tests/v1/kv_connector/unit/utils.py``
(``create_vllm_config``: ``KVTransferConfig`` with ``kv_connector_module_path``;
``create_scheduler``: a real ``Scheduler`` whose connector the factory builds in
the scheduler role). Worker-side KV caches are laid out by 0.34's own code
(``pad_kv_cache_segments``, ``create_kv_cache_views``) over a CPU buffer, with
the geometry a worker connector sees when 0.34 creates it after warm-up.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

import torch
from tests.v1.kv_connector.unit.utils import (
    create_model_runner_output,
    create_scheduler,
    create_vllm_config,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.extensible_kv_cache import pad_kv_cache_segments

from vllm_ext.assets import model_path
from vllm_ext.serving import free_port

BLOCK = 16
# what create_vllm_config resolves; connectors are built after layout resolution
LAYOUT = KVCacheLayout.LBNHC
ACCT = {"kv_connector": "AcctConnector", "kv_connector_module_path": "vllm_ext.acct.connector"}
ARK = {"kv_connector": "ArkConnector", "kv_connector_module_path": "vllm_ext.ark.connector"}
ARK_NIXL = {"kv_connector": "ArkNixlConnector", "kv_connector_module_path": "vllm_ext.ark.nixl"}
LEAP = {"kv_connector": "LeapConnector", "kv_connector_module_path": "vllm_ext.leap.connector"}


def smollm2() -> str:
    return str(model_path("smollm2"))


def acct_config(**acct):
    """ACCT on SmolLM2 (a local folder, as ACCT requires), identity import, fp32."""
    config = create_vllm_config(model=smollm2(), kv_role="kv_both", dtype="float32",
                                block_size=BLOCK, max_num_batched_tokens=256,
                                kv_load_failure_policy="recompute", **ACCT)  # fmt: skip
    block = {"checkpoint": "identity", "min_prefix_tokens": 32, "check_tokens": 0, **acct}
    config.additional_config = {"acct": block}
    return config


def ark_config(role: str, **ark):
    """ARK on loopback: fresh announce and data ports, recompute on a lost load."""
    config = create_vllm_config(kv_role=role, dtype="float32", block_size=BLOCK,
                                max_num_batched_tokens=256,
                                kv_load_failure_policy="recompute", **ARK)  # fmt: skip
    config.additional_config = {"ark": {"announce_port": free_port(), "data_port": free_port(),
                                        "load_timeout_s": 5.0, **ark}}  # fmt: skip
    return config


def leap_config():
    return create_vllm_config(kv_role="kv_both", **LEAP)


def scheduler_for(config, num_blocks: int = 200):
    """0.34's ``Scheduler``; the factory builds our connector in the scheduler role."""
    return create_scheduler(config, num_blocks=num_blocks)


def attention_spec(config) -> FullAttentionSpec:
    model = config.model_config
    return FullAttentionSpec(block_size=BLOCK, num_kv_heads=model.get_total_num_kv_heads(),
                             head_size=model.get_head_size(), dtype=model.dtype)  # fmt: skip


def layer_names(config) -> list[str]:
    layers = config.model_config.hf_config.num_hidden_layers
    return [f"model.layers.{i}.self_attn.attn" for i in range(layers)]


def committed_cache(config, num_blocks: int, granule: int = 1 << 16,
                    kernel_block_size: int | None = None):
    """``(kv_cache_config, kv_caches)`` as a worker connector sees them after 0.34's warm-up.

    Each layer's region is padded to ``granule`` (``pad_kv_cache_segments``) and
    the views span ``num_blocks`` committed blocks (``create_kv_cache_views``),
    which is the block count in the config the connector is created with; with
    ``kernel_block_size`` each block is split into kernel blocks along the block
    dimension, as 0.34 does where the attention kernel needs smaller pages.
    """
    spec, names = attention_spec(config), layer_names(config)
    page = spec.page_size_bytes
    tensor = KVCacheTensor(size=page * num_blocks * len(names), layers=names,
                           layer_stride=page * num_blocks, block_stride=page)  # fmt: skip
    kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[tensor],
                                    kv_cache_groups=[KVCacheGroupSpec(names, spec)])  # fmt: skip
    kv_cache_config = pad_kv_cache_segments(kv_cache_config, LAYOUT, granule)
    (padded,) = kv_cache_config.kv_cache_tensors
    raw = torch.zeros(padded.size, dtype=torch.int8)
    views = create_kv_cache_views(raw, spec, num_blocks, LAYOUT, padded,
                                  kernel_block_size=kernel_block_size)  # fmt: skip
    return kv_cache_config, dict(zip(names, views, strict=True))


def worker_after_warm_up(config, num_blocks: int, capacity: int,
                         kernel_block_size: int | None = None):
    """A worker connector created as 0.34's ``extend_kv_cache`` creates it, registered.

    At that moment ``cache_config.num_gpu_blocks`` still holds the reserved
    capacity (it is set to the committed count only afterwards); the connector's
    own ``kv_cache_config`` has the committed count.
    """
    config = copy.copy(config)
    config.cache_config = copy.copy(config.cache_config)
    config.cache_config.num_gpu_blocks = capacity
    kv_cache_config, kv_caches = committed_cache(config, num_blocks,
                                                 kernel_block_size=kernel_block_size)
    connector = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER,
                                                    kv_cache_config)  # fmt: skip
    connector.register_kv_caches(kv_caches)
    return connector, kv_caches


def step(scheduler, requests: Iterable, **connector_output):
    """One engine step: schedule, a fabricated ``ModelRunnerOutput`` for the scheduled
    ``requests`` (one token each), update. Returns ``(scheduler_output, engine_outputs)``."""
    scheduler_output = scheduler.schedule()
    ran = [r for r in requests if r.request_id in scheduler_output.num_scheduled_tokens]
    output = create_model_runner_output(ran, **connector_output)
    return scheduler_output, scheduler.update_from_output(scheduler_output, output)


def finished_outputs(engine_outputs) -> dict[str, object]:
    """request id -> its finished ``EngineCoreOutput`` in one step's outputs."""
    return {
        out.request_id: out
        for outputs in engine_outputs.values()
        for out in outputs.outputs
        if out.finish_reason is not None
    }
