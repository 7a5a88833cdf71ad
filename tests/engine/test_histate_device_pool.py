"""HiState keeps held snapshots off the device pool: freed Mamba blocks lose their cache entry.

Real tiny Qwen3-Next engine with prefix caching (align mode), no connector:
with every snapshot declared held, a repeated prompt gets no device hit (its
recurrent state is no longer cached on the device), outputs are unchanged and
no block leaks; without the wrap the same repeat hits the device cache.
"""

from __future__ import annotations

from vllm_ext.patches import mamba_external_state_count

from tests.engine.leap_helpers import scheduler_of
from tests.helpers import engine
from vllm_ext.histate.device_pool import SnapshotsOffDevice, keep_snapshots_off_device

PROMPT = [100 + (7 * i) % 5000 for i in range(900)]  # > 2 blocks of 384 tokens


def _run_twice(llm):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0]
    again = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0]
    return first, again


def test_held_snapshots_leave_the_device_cache_and_outputs_stay_the_same():
    kwargs = dict(dtype="bfloat16", enable_prefix_caching=True, max_model_len=2048)
    with engine("tiny-hybrid", **kwargs) as llm:
        plain_first, plain_again = _run_twice(llm)
    del llm  # tests/helpers.engine: no reference may outlive the engine
    assert plain_again.num_cached_tokens >= 384  # vLLM's own device hit

    released = []
    with engine("tiny-hybrid", **kwargs) as llm:
        manager = scheduler_of(llm).kv_cache_manager
        assert keep_snapshots_off_device(manager, lambda block: True, released.append) == 1
        assert keep_snapshots_off_device(manager, lambda block: True) == 0  # idempotent
        assert mamba_external_state_count.apply(manager) == 1  # the Mamba manager's count
        assert mamba_external_state_count.apply(manager) == 0
        assert mamba_external_state_count.is_applied(manager)
        first, again = _run_twice(llm)
        pool = manager.block_pool
        assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1  # minus the null block
        mamba = [m for m in manager.coordinator.single_type_managers
                 if isinstance(m.block_pool, SnapshotsOffDevice)]  # fmt: skip
        assert len(mamba) == 1
        # the coordinator resets each pool once: the view counts as the pool it wraps
        pools = [m.block_pool for m in manager.coordinator.single_type_managers]
        assert len(dict.fromkeys(pools)) == 1
    del llm, manager, pool, mamba, pools
    assert sum(released) >= 2  # both runs released their boundary snapshots
    assert again.num_cached_tokens == 0  # no snapshot on the device: no device hit
    for a, b in ((plain_first, first), (plain_again, again)):
        assert list(a.outputs[0].token_ids) == list(b.outputs[0].token_ids)
