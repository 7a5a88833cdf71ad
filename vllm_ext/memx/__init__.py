"""MemX: memory-balanced parallel-configuration search for mixed-vendor clusters (no vLLM).

:mod:`.spec` reads cluster and model descriptions, :mod:`.model` costs one plan
(iteration time, peak memory per device group), :mod:`.search` enumerates and
scores the whole space with numpy, :mod:`.serving` plans ``vllm serve`` per
device group, :mod:`.cli` is ``vllm-ext memx``. See docs/memx.md.
"""
