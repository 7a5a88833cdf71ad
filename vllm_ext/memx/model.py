"""Cost and memory model of one pipeline stage group, written once for scalars and numpy arrays.

A plan orders the device groups into one pipeline; group ``g`` runs ``k``
consecutive stages, each ``dp``-way data parallel and ``tp``-way tensor
parallel (``k * dp * tp`` = the group's GPUs), holds ``n`` layers (``ceil(n/k)``
per stage: the slowest and fullest stage counts) and recomputes activations or
not. Every function here broadcasts, so :mod:`.search` costs millions of plans
with the same code the hand-checkable tests call with plain numbers.

Sources: FLOPs 2·params·tokens (+ causal attention) forward, 2× backward;
activations per layer s·b·h·(10 + 24/t) bytes (Korthikanti et al. 2022, with
flash attention, no sequence parallelism); ring all-reduce 2(d−1)/d·bytes/bw;
1F1B makespan (m−1)·max stage + Σ stages.
"""

from __future__ import annotations

import numpy as np

from vllm_ext.memx.spec import GIB, DeviceGroup, ModelSpec

# bytes per parameter: weights + grads (bf16) and optimizer state (fp32 master + moments)
_OPT_BYTES = {"adam": 12, "sgd": 8}


def layers_per_stage(n, k):
    """Layers on the group's fullest stage (``ceil(n / k)``)."""
    return -(-np.asarray(n) // np.asarray(k))


def stage_params(m: ModelSpec, layers, tp, first, last):
    """Parameters one device of the stage holds (embedding on the first, LM head on the last)."""
    return (layers * m.layer_params + (first + last) * m.embed_params) / tp


def static_bytes(m: ModelSpec, params, dp):
    """Weights, gradients and optimizer state per device, sharded over dp by ZeRO."""
    w = params * m.dtype_bytes / (dp if m.zero_stage >= 3 else 1)
    g = params * m.dtype_bytes / (dp if m.zero_stage >= 2 else 1)
    o = params * _OPT_BYTES[m.optimizer] / (dp if m.zero_stage >= 1 else 1)
    return w + g + o


def activation_bytes(m: ModelSpec, seq, b, tp, layers, rc, inflight):
    """Activations kept for ``inflight`` micro-batches; ``rc`` = full recompute (inputs only)."""
    tokens = seq * b
    full = tokens * m.hidden * (10 + 24 / tp)
    saved = inflight * layers
    # a recomputing stage keeps each layer's input and rebuilds one layer's activations at a time
    return np.where(rc, (saved - 1) * 2 * tokens * m.hidden + full, saved * full)


def logits_bytes(m: ModelSpec, seq, b, tp, last):
    """bf16 logits and their fp32 copy for the loss, one micro-batch, on the last stage."""
    return last * seq * b * m.vocab * 6 / tp


def peak_bytes(m, grp: DeviceGroup, seq, mb, n, k, dp, tp, rc, inflight, first, last):
    """Peak memory of one device on the group's fullest stage."""
    layers = layers_per_stage(n, k)
    b = mb / dp
    params = stage_params(m, layers, tp, first, last)
    return (
        static_bytes(m, params, dp)
        + activation_bytes(m, seq, b, tp, layers, rc, inflight)
        + logits_bytes(m, seq, b, tp, last)
        + grp.workspace_gib * GIB
    )


def sailor_peak_bytes(m, seq, mb, n, k, dp, tp, rc, inflight, first, last):
    """Sailor's accounting (eth-easl/sailor, runtime_simulator.py, MIT; re-derived, not copied).

    24 bytes per parameter with no ZeRO (fp32 model, grads, comm buffer, 2 DeepSpeed
    copies, Adam), activations × (stages after this one), 2 GB (tp=1) or 3 GB framework memory.
    """
    layers = layers_per_stage(n, k)
    params = stage_params(m, layers, tp, first, last)
    act = activation_bytes(m, seq, mb / dp, tp, layers, rc, inflight)
    return params * 24 + act + np.where(tp > 1, 3e9, 2e9)


def layer_times(m: ModelSpec, grp: DeviceGroup, seq, b, tp, rc):
    """(forward+backward+recompute, backward) seconds of one layer for one micro-batch."""
    tokens = seq * b
    fwd_flops = 2 * m.layer_params * tokens + 2 * seq * tokens * m.hidden
    fwd = fwd_flops / tp / (grp.bf16_tflops * 1e12 * grp.mfu)
    bwd = 2 * fwd
    allreduce = np.where(
        tp > 1, 2 * (tp - 1) / tp * tokens * m.hidden * m.dtype_bytes / (grp.intra_gbps * 1e9), 0
    )
    # 2 all-reduces forward, 2 backward, 2 more when the forward is recomputed
    total = fwd + bwd + rc * fwd + (4 + 2 * rc) * allreduce
    return total, bwd + 2 * allreduce


def stage_time(m, grp, seq, mb, n, k, dp, tp, rc, last, hop_gbps):
    """Seconds per micro-batch of the group's slowest stage, its send/receive included."""
    layers = layers_per_stage(n, k)
    b = mb / dp
    per_layer, _ = layer_times(m, grp, seq, b, tp, rc)
    head = last * 3 * 2 * m.embed_params * seq * b / tp / (grp.bf16_tflops * 1e12 * grp.mfu)
    hop = 2 * seq * b * m.hidden * m.dtype_bytes / (hop_gbps * 1e9)
    return layers * per_layer + head + hop


def tail_time(m, grp: DeviceGroup, seq, mb, n, k, dp, tp, rc, first, last):
    """Exposed gradient all-reduce (overlapped with the last backward) plus the optimizer step."""
    layers = layers_per_stage(n, k)
    params = stage_params(m, layers, tp, first, last)
    bw = np.where(tp * dp <= grp.gpus_per_node, grp.intra_gbps, grp.inter_gbps) * 1e9
    ring = np.where(dp > 1, 2 * (dp - 1) / dp * params * m.dtype_bytes / bw, 0)
    _, bwd = layer_times(m, grp, seq, mb / dp, tp, rc)
    exposed = np.maximum(0, ring - layers * bwd)
    shard = dp if m.zero_stage >= 1 else 1
    step = params / shard * (2 * m.dtype_bytes + 2 * _OPT_BYTES[m.optimizer]) / (grp.hbm_gbps * 1e9)
    return exposed + step


def iteration_time(stage_times, stages, tails, micro_batches):
    """1F1B: (m − 1) · slowest stage + Σ over all stages, then the slowest tail."""
    slowest = np.max(np.stack(np.broadcast_arrays(*stage_times)), axis=0)
    total = sum(k * t for k, t in zip(stages, stage_times, strict=True))
    return (micro_batches - 1) * slowest + total + np.max(np.stack(np.broadcast_arrays(*tails)), 0)


def ideal_time(m, groups, seq, gbs) -> float:
    """Lower bound: all training FLOPs spread over the cluster's effective FLOP rate."""
    flops = (
        3
        * (
            2 * (m.layers * m.layer_params + m.embed_params) * seq
            + 2 * m.layers * seq * seq * m.hidden
        )
        * gbs
    )
    rate = sum(g.count * g.bf16_tflops * 1e12 * g.mfu for g in groups)
    return flops / rate
