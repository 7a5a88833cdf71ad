"""Which tests check compat's ``instance`` entries on vLLM's real objects, per release.

An ``instance`` entry names an attribute vLLM sets in ``__init__``; importing
the class cannot show it. These tests build the objects and call
:func:`vllm_ext.common.compat.check_instance`; each asserts it verifies every
instance entry except those listed here as not built, so this table and the
tests cannot drift apart. compat_check marks the rest "unverified" in
docs/compat.md. Imports no vLLM.
"""

from __future__ import annotations

# per release: the test that checks instance entries on vLLM's real objects, and the
# instance entries it does not build (the test asserts it verifies all the others)
_GDN = "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn.QwenGatedDeltaNetAttention"
_ATTN = "vllm.model_executor.layers.attention.attention.Attention"
# Flide's packed pass checks these on every layer of the served model (flide.forward.
# check_supported), which the 0.32 engine tests run; no 0.34 engine builds those layers
_FLIDE_LAYERS = frozenset({
    *(f"{_GDN}.{a}" for a in ("in_proj_qkvz", "in_proj_ba", "gqa_interleaved_layout", "key_dim",
                              "value_dim", "tp_size", "head_v_dim", "conv1d", "activation",
                              "A_log", "dt_bias", "conv_kernel_size")),
    *(f"{_ATTN}.{a}" for a in ("num_heads", "num_kv_heads", "head_size", "head_size_v", "impl",
                               "sliding_window")),
})  # fmt: skip
ENGINE_CHECKED = {
    "0.32.0": ("tests/engine/test_flide_engine.py (flide.forward.check_supported)", _FLIDE_LAYERS)
}
_NOT_BUILT = _FLIDE_LAYERS | frozenset({
    "torch.nn.Module._modules",
    "vllm.distributed.kv_transfer.kv_connector.v1.multi_connector.MultiConnector._connectors",
    "vllm.v1.core.single_type_kv_cache_manager.MambaManager.block_pool",
    "vllm.v1.core.single_type_kv_cache_manager.MambaManager.mamba_cache_mode",
    "vllm.v1.core.sched.output.KVConnectorBlockState.boundary_state_offloads",
    "vllm.v1.worker.gpu_model_runner.GPUModelRunner.input_batch",
    "vllm.v1.worker.gpu_model_runner.GPUModelRunner.query_start_loc",
})  # fmt: skip
_INSTANCE_TEST = "tests/vllm034/test_compat_instances.py"
INSTANCE_TESTS = {
    "0.32.0": (f"{_INSTANCE_TEST} (run on 0.32 by tests/engine/test_compat_seams.py)", _NOT_BUILT),
    "0.34.0": (_INSTANCE_TEST, _NOT_BUILT),
}
