"""Plumbing shared by every vllm_ext system: version gate, config, logging, counters."""
