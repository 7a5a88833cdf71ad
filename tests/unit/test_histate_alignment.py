"""HiState's start-up check refuses chunking under which no snapshot could be stored."""

from __future__ import annotations

import random

from vllm_ext.histate.alignment import chunk_limit, chunking_problem, state_dtype_problem


def _chunk_ends(prompt: int, limit: int, align: int) -> list[int]:
    """Chunk ends vLLM 0.32's scheduler issues: limit-sized chunks floored to ``align``."""
    ends, start = [], 0
    while start < prompt:
        end = min(start + limit, prompt)
        if end < prompt:
            end = max(end // align * align, start + align)
        ends.append(end)
        start = end
    return ends


def test_accepted_chunking_ends_chunks_on_every_block_boundary_in_random_layouts():
    rng = random.Random(7)
    accepted = missed = 0
    for _ in range(300):
        block = rng.choice([384, 528, 640, 1056])
        align = rng.choice([16, 128, block])
        limit = rng.choice([block, 2048, 512, 8192, block // 2])
        prompt = rng.randint(block + 1, 6 * block)
        ends = _chunk_ends(prompt, limit, align)
        boundaries = set(range(block, prompt, block))
        if align == block:
            continue
        if chunking_problem(block, align, limit) is None:
            # the EngineCore case: every boundary below the prompt end is a chunk end
            assert boundaries <= set(ends), (block, align, limit, prompt)
            accepted += 1
        else:
            missed += not boundaries <= set(ends)
    assert accepted > 20 and missed > 20


def test_refuses_the_defaults_naming_the_flag_and_the_block_size():
    problem = chunking_problem(640, 16, chunk_limit(2048, 0))
    assert problem is not None and problem.endswith("pass --max-num-batched-tokens 640")
    assert "\n" not in problem
    assert chunking_problem(640, 16, chunk_limit(640, 0)) is None
    # vLLM aligns chunks itself when its Mamba block is the hybrid block (one process)
    assert chunking_problem(384, 384, 512) is None
    # a long-prefill threshold shorter than the batch limit sets the chunk length
    assert chunk_limit(2048, 384) == 384
    assert chunking_problem(384, 16, chunk_limit(2048, 384)) is None


def test_state_dtypes_outside_the_handled_ones_are_refused_naming_the_flag():
    assert state_dtype_problem(["bfloat16", "float32"]) is None
    problem = state_dtype_problem(["float8_e4m3fn", "bfloat16"])
    assert problem is not None and "float8_e4m3fn" in problem
    assert problem.endswith("pass --mamba-ssm-cache-dtype bfloat16")
