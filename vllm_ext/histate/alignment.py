"""Start-up check: can HiState store anything with this engine's chunking? (No vLLM.)

HiState stores a recurrent-state snapshot only where a prefill chunk ends on
a block boundary (Mamba align mode keeps the state at exactly ``k * block``
tokens nowhere else). In vLLM 0.32's multiprocess engine the EngineCore's
scheduler aligns chunk ends to its own pre-hybrid block size (the platform
raises the block to the Mamba page size, e.g. 384 or 640 tokens, in the
worker; the EngineCore keeps ``mamba_block_size`` at the old value), so only
a chunk limit equal to the hybrid block makes chunks end on its boundaries.
Without the check the connector stored KV but never a snapshot, and never hit.
"""

from __future__ import annotations

STATE_DTYPES = ("bfloat16", "float16", "float32")


def chunk_limit(max_num_scheduled_tokens: int, long_prefill_token_threshold: int) -> int:
    """The longest prefill chunk the scheduler issues (vLLM's ``_mamba_block_aligned_split``)."""
    if long_prefill_token_threshold > 0:
        return min(max_num_scheduled_tokens, long_prefill_token_threshold)
    return max_num_scheduled_tokens


def chunking_problem(block_size: int, mamba_block_size: int | None, limit: int) -> str | None:
    """Why chunks cannot end on ``block_size`` boundaries, naming the flag to pass; else None.

    Args:
        block_size: the hybrid (attention = Mamba) block size HiState keys by.
        mamba_block_size: the granularity the scheduler aligns chunk ends to.
        limit: :func:`chunk_limit`.
    """
    if mamba_block_size == block_size:
        return None
    if limit == block_size and mamba_block_size and block_size % mamba_block_size == 0:
        return None
    return (
        f"HiState needs prefill chunks that end on the {block_size}-token block boundaries "
        f"(Mamba align mode), but chunks of up to {limit} tokens are aligned to "
        f"{mamba_block_size} tokens: pass --max-num-batched-tokens {block_size}"
    )


def state_dtype_problem(dtypes) -> str | None:
    """A recurrent-state dtype the snapshot store does not handle, naming the flag; else None.

    Args:
        dtypes: names of the Mamba group's state dtypes (``"bfloat16"``, ...).
    """
    bad = sorted({d for d in dtypes if d not in STATE_DTYPES})
    if not bad:
        return None
    return (
        f"HiState stores recurrent states in {', '.join(STATE_DTYPES)}, got {', '.join(bad)}: "
        f"pass --mamba-ssm-cache-dtype bfloat16"
    )
