"""Cost model of one serving instance: a 7B-class GDN hybrid on one H200 with NVMe.

Every number is an assumption derived from public figures (no H200 was
measured); :meth:`CostModel.describe` puts them and these notes into the
benchmark JSON.

Model (a Qwen3-Next-style 3:1 layout scaled to 7B): 32 layers = 24 Gated
DeltaNet + 8 full-attention layers; attention GQA with 4 KV heads of dim 128
in bf16 -> KV = 8 layers x 2 (K,V) x 4 x 128 x 2 B = **16 KiB per token**.
GDN state per layer: 32 value heads x 128 x 128 in fp32 (vLLM keeps the
recurrent state in fp32) = 2 MiB, plus a conv state of 3 x 8192 bf16 = 48 KiB
-> **~49 MiB per snapshot** (24 layers). Cross-check: SGLang reports
~51 MB per Mamba snapshot for Qwen3.5-4B (sglang#39851).

Prefill: 2 x 7e9 FLOPs per token on an H200 (989 dense bf16 TFLOP/s) at
~35% MFU -> **40 us per token** (25k tokens/s); attention adds
4 x d_model x context FLOPs per token per attention layer (8 x 4 x 4096 =
131k x context) at ~50% of peak -> **2.6e-10 s per token per context token**
(recomputing 100k tokens: 4.0 s + 1.3 s). Decode: 7B bf16 weights (15 GB)
streamed at 4.8 TB/s in a batch of ~32 sequences -> **12 ms per output token**
per sequence (decode runs beside prefill; only prefill is queued).

Memory: the H200's 141 GB minus weights, activations and graphs leaves
~100 GB, but the instance's cache pool is a parameter (``device_bytes``) so the
trace's working set can be a few times the device pool, the regime of the
paper and of reliability.md 9.2.12. Host DRAM and SSD capacities are
parameters too. Links: host<->device over PCIe Gen5 x16, **50 GB/s**
measured-class pinned copies; SSD: one PCIe Gen4 enterprise NVMe (e.g.
Samsung PM9A3: 6.9 GB/s read, 4.1 GB/s write) -> **6.5 GB/s read,
3.5 GB/s write, 100 us per read**. SSD writes (spills) are asynchronous; a
spill that would queue more than ``ssd_max_backlog_s`` of writes is dropped.
vLLM's own (native, ``--mamba-cache-mode align``) caching keeps a device
snapshot at the end of each prefill chunk (``chunk_tokens``), of the prompt
and of the decode.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

GB = 10**9


@dataclass(frozen=True)
class CostModel:
    """Timing and sizes of the simulated instance (see the module docstring)."""

    prefill_s_per_token: float = 4.0e-5
    prefill_s_per_token2: float = 2.6e-10
    decode_s_per_token: float = 0.012
    kv_bytes_per_token: int = 16 * 1024
    state_bytes: int = 24 * (32 * 128 * 128 * 4 + 3 * 8192 * 2)
    device_bytes: int = 40 * GB
    host_bytes: int = 128 * GB
    ssd_bytes: int = 1000 * GB
    h2d_bytes_per_s: float = 50 * GB
    ssd_read_bytes_per_s: float = 6.5 * GB
    ssd_write_bytes_per_s: float = 3.5 * GB
    ssd_read_latency_s: float = 100e-6
    ssd_max_backlog_s: float = 2.0
    chunk_tokens: int = 8192

    def prefill_seconds(self, tokens: int, end_position: int) -> float:
        """Compute time of ``tokens`` prompt tokens ending at ``end_position``."""
        start = max(0, end_position - tokens)
        quad = 0.5 * (end_position * end_position - start * start)
        return self.prefill_s_per_token * tokens + self.prefill_s_per_token2 * quad

    def kv_block_bytes(self, block_size: int) -> int:
        """Bytes of one KV block of ``block_size`` tokens (all attention layers)."""
        return self.kv_bytes_per_token * block_size

    def snapshot_read_seconds(self, tier: str) -> float:
        """Time to bring one snapshot from ``tier`` to the device."""
        if tier == "device":
            return 0.0
        if tier == "host":
            return self.state_bytes / self.h2d_bytes_per_s
        return self.ssd_read_latency_s + self.state_bytes / self.ssd_read_bytes_per_s

    def describe(self) -> dict[str, Any]:
        """Every parameter plus the sources, for result files."""
        return {**asdict(self), "sources": __doc__}


QWEN3_NEXT_80B_H100_SOURCES = """\
Qwen3-Next-80B-A3B served by vLLM on H100s (issue 36's cost model; assumptions from public
figures, nothing here was measured on an H100).

Model (config.json of Qwen/Qwen3-Next-80B-A3B-Instruct): 48 layers, full_attention_interval
4 -> 12 gated-attention + 36 Gated-DeltaNet layers; attention 16 query / 2 KV heads of dim
256; GDN 16 key / 32 value heads of dim 128, conv kernel 4; 512 experts (10 routed + 1
shared), ~3B active parameters per token.
- KV per token (bf16): 12 layers x 2 (K,V) x 2 heads x 256 x 2 B = **24 KiB**.
- Snapshot: vLLM keeps Qwen3-Next's recurrent state in the model dtype (mamba_ssm_cache_dtype
  "auto"; only NemotronH defaults to fp32): per GDN layer 32 x 128 x 128 x 2 B = 1 MiB plus a
  conv state of 3 x 8192 x 2 B = 48 KiB -> 36 layers = **37.7 MiB**.
- Block size: align mode makes an attention page at least one Mamba page: 1,097,728 B per layer
  / 2 KiB per token = 536 tokens, rounded to the GDN prefill checkpoint alignment (64) ->
  **576 tokens** (vLLM issues report 528+ on real hybrids).
Instance: the FP8 checkpoint (~82 GB) does not fit one 80 GB H100, so the smallest deployment
is **2 x H100 SXM, TP=2** (weights ~41 GB per GPU); every number below is per instance.
- Prefill: 2 x 3e9 FLOPs per token at 30% of 2 x 989 dense bf16 TFLOP/s -> **10 us per token**
  (100k tokens/s); attention adds 12 layers x 4 x 4096 (16 heads x 256) FLOPs per token per
  context token at 50% of peak -> **2.0e-10 s per token per context token**.
- Decode: ~3 GB of active FP8 weights plus the batch's KV read per step, batches of
  ~64 sequences -> **15 ms per output token** per sequence (only decides when the next turn
  arrives; prefills are queued FCFS). Prefill chunks: max_num_batched_tokens 8192, cut at
  block boundaries (14 blocks = 8064 tokens); native align mode keeps a state at each chunk end.
- Cache pool: 2 x (80 GB - 41 GB weights - ~9 GB activations, graphs, NCCL) = **60 GB** of
  device memory for KV + states; host DRAM tier swept; SSD tier 2 TB.
- Host <-> device: PCIe Gen5 x16 per GPU, ~50 GB/s pinned copies each, the two GPUs reading
  their own TP shards in parallel -> **100 GB/s**.
- SSD: one PCIe Gen4 enterprise NVMe (Samsung PM9A3 class: 6.9 GB/s read, 4.1 GB/s write)
  -> **6.5 GB/s read, 3.5 GB/s write, 100 us per read**; spills are asynchronous.
"""
QWEN3_NEXT_80B_BLOCK = 576


def qwen3_next_80b_h100(**changes: Any) -> CostModel:
    """The cost model of :data:`QWEN3_NEXT_80B_H100_SOURCES` (``changes`` override fields)."""
    base = CostModel(
        prefill_s_per_token=1.0e-5,
        prefill_s_per_token2=2.0e-10,
        decode_s_per_token=0.015,
        kv_bytes_per_token=24 * 1024,
        state_bytes=36 * (32 * 128 * 128 * 2 + 3 * 8192 * 2),
        device_bytes=60 * GB,
        host_bytes=128 * GB,
        ssd_bytes=2000 * GB,
        h2d_bytes_per_s=100 * GB,
        ssd_read_bytes_per_s=6.5 * GB,
        ssd_write_bytes_per_s=3.5 * GB,
        ssd_read_latency_s=100e-6,
        ssd_max_backlog_s=2.0,
        chunk_tokens=14 * QWEN3_NEXT_80B_BLOCK,  # max_num_batched_tokens 8192, cut at blocks
    )
    return replace(base, **changes)
