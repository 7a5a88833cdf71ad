"""Serving plan per device group: the smallest TP×PP whose memory holds weights and KV cache.

Each device group serves its own replicas (vLLM runs one vendor per
instance): per group, tp (within a node, dividing the KV heads) and pp are the
smallest whose per-GPU weights + KV cache for ``concurrency × context`` tokens
fit ``gpu_memory_utilization`` of the GPU; the rest of the group becomes
data-parallel replicas. Output: the ``vllm serve`` arguments per group.
"""

from __future__ import annotations

import dataclasses

from vllm_ext.memx.spec import GIB, Cluster, ModelSpec, SpecError


@dataclasses.dataclass(frozen=True)
class ServePlan:
    group: str
    tp: int
    pp: int
    replicas: int
    weights_gib: float  # per GPU
    kv_gib: float  # per GPU
    util: float

    def args(self, model: str, gpu_memory_utilization: float) -> list[str]:
        return [
            "vllm",
            "serve",
            model,
            "--tensor-parallel-size",
            str(self.tp),
            "--pipeline-parallel-size",
            str(self.pp),
            "--data-parallel-size",
            str(self.replicas),
            "--gpu-memory-utilization",
            f"{gpu_memory_utilization:g}",
        ]


def kv_bytes_per_token(m: ModelSpec) -> int:
    return 2 * m.layers * m.kv_heads * m.head_dim * m.dtype_bytes


def plan_serving(
    cluster: Cluster,
    m: ModelSpec,
    context: int,
    concurrency: int,
    gpu_memory_utilization: float = 0.9,
) -> list[ServePlan]:
    """One :class:`ServePlan` per device group; SpecError naming the group that cannot fit."""
    weights = (m.layers * m.layer_params + 2 * m.embed_params) * m.dtype_bytes
    kv = kv_bytes_per_token(m) * context * concurrency
    plans = []
    for grp in cluster.groups:
        budget = grp.mem_bytes * gpu_memory_utilization - grp.workspace_gib * GIB
        best = None
        for size in range(1, grp.count + 1):
            # the largest tp first: tensor parallelism within a node keeps latency lowest
            for tp in (t for t in range(min(size, grp.gpus_per_node), 0, -1) if size % t == 0):
                pp = size // tp
                if m.kv_heads % tp or grp.count % size or pp > m.layers:
                    continue
                need = (weights + kv) / size
                if need <= budget:
                    best = ServePlan(
                        grp.name,
                        tp,
                        pp,
                        grp.count // size,
                        weights / size / GIB,
                        kv / size / GIB,
                        need / grp.mem_bytes,
                    )
                    break
            if best:
                break
        if best is None:
            raise SpecError(
                f"group {grp.name!r}: {weights / GIB:.1f} GiB of weights + "
                f"{kv / GIB:.1f} GiB of KV cache do not fit its {grp.count} GPUs "
                f"of {grp.mem_gib:g} GiB"
            )
        plans.append(best)
    return plans
