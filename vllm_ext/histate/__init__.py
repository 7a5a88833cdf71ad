"""HiState: recurrent-state snapshots tiered to host memory and SSD, one eviction queue.

For hybrid models (Gated DeltaNet / Mamba + attention), a prefix hit needs the
attention KV of every matched block and the recurrent state at exactly the
match point. HiState keeps many historical snapshots (host memory, then SSD)
and KV blocks (host memory) in one eviction queue scored by what an eviction
loses per byte freed, on a GreedyDual clock (:mod:`vllm_ext.histate.policy`).

Algorithm modules (no vLLM import, unit-testable alone):

- :mod:`vllm_ext.histate.config` -- ``HiStateConfig``, the one frozen config.
- :mod:`vllm_ext.histate.policy` -- items, ``lru`` / ``marconi`` / ``histate`` policies.
- :mod:`vllm_ext.histate.queue` -- ``EvictionQueue``: one capacity-bounded queue per tier.
- :mod:`vllm_ext.histate.tiers` -- ``TieredCache``: host + SSD tiers, spill, pinning.
- :mod:`vllm_ext.histate.snapfile` -- ``SnapshotStore``: crash-consistent snapshot files.
- :mod:`vllm_ext.histate.fingerprint` -- a digest of every weight byte, for the namespace.
- :mod:`vllm_ext.histate.namespaces` -- which other namespaces' files can never hit again.
- :mod:`vllm_ext.histate.lookup` -- longest hit (KV + snapshot), recompute accounting.
- :mod:`vllm_ext.histate.counters` -- counter names.
- :mod:`vllm_ext.histate.traces` -- agentic-coding and BFCL request traces (JSONL).
- :mod:`vllm_ext.histate.costmodel` / :mod:`vllm_ext.histate.simulator` -- calibrated
  trace-driven simulator of one serving instance running the same policy classes.

This package file imports nothing, so importing a submodule never pulls in the
vLLM adapters.
"""
