"""HiState's CachePolicy wherever vLLM's offloading tests build a manager with lru or arc.

``install()`` (run by :mod:`swap_plugin` before vLLM's test modules import)
wraps ``CPUOffloadingManager.__init__``: a manager asked for ``"lru"`` or
``"arc"`` gets ``"histate"`` (:class:`vllm_ext.histate.cache_policy.HiStateCachePolicy`,
registered here as the plugin registers it). Other names (the factory tests'
dummy policies) are left alone, and so is ``CachePolicyFactory`` itself. Every
public manager call is then followed by the slot checks of
:mod:`histate_manager_checks` (no slot leaked, none freed twice, counts
right), so a vLLM test that passes with HiState also proved those after every
step it took (managers holding a test's own policy are not checked).
"""

from __future__ import annotations

import functools
import inspect

import histate_manager_checks

SWAPPED = ("lru", "arc")
CHECKED_CALLS = (
    "prepare_store", "complete_store", "prepare_load", "complete_load", "touch",
    "on_request_finished", "reset_cache", "take_events",
)  # fmt: skip


def install() -> None:
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    from vllm_ext.histate.cache_policy import NAME, register

    register()
    original = CPUOffloadingManager.__init__
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        if bound.arguments["cache_policy"] in SWAPPED:
            bound.arguments["cache_policy"] = NAME
        original(*bound.args, **bound.kwargs)

    CPUOffloadingManager.__init__ = __init__
    for name in CHECKED_CALLS:
        if hasattr(CPUOffloadingManager, name):  # touch: vLLM 0.32/0.33 only
            setattr(CPUOffloadingManager, name, _checked(getattr(CPUOffloadingManager, name)))


def _checked(method):
    if inspect.isgeneratorfunction(method):

        @functools.wraps(method)
        def drain(self, *args, **kwargs):
            yield from method(self, *args, **kwargs)
            _check(self, method.__name__)

        return drain

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        result = method(self, *args, **kwargs)
        _check(self, method.__name__)
        return result

    return call


def _check(manager, call: str) -> None:
    from vllm_ext.histate.cache_policy import HiStateCachePolicy

    if not isinstance(manager._policy, HiStateCachePolicy):
        return  # a test's own policy (the factory tests' dummies)
    problems = histate_manager_checks.manager_problems(manager)
    assert not problems, f"after {call}: " + "; ".join(problems)
