"""ACCT's counters (published as ``vllm_ext:acct_<name>_total``)."""

from vllm_ext.common.counters import CounterSpec

COUNTER_SPECS = (
    CounterSpec("imported_tokens", "prompt tokens whose KV was imported instead of prefilled"),
    CounterSpec("conversion_seconds", "seconds spent running the source and the converters"),
    CounterSpec("gate_failures", "imports the online check rejected"),
    CounterSpec("recomputes", "imports handed back to vLLM's own prefill (gate or error)"),
)
