"""Tell the LEAP loader which V1 model runner is loading it (vLLM 0.32-0.33, V1 runner).

vLLM's loader API (``BaseModelLoader.load_model(vllm_config, model_config)``)
hands a loader no reference to the model runner. LEAP's probe needs the V1
runner's persistent batch to map rows to requests, because V1 calls the KV
connector's ``start_load_kv`` without request ids (Model Runner V2 passes them,
and needs nothing from here). The patch wraps ``load_model`` of the V1 runner
classes so that, while it runs, :func:`loading_runner` returns that runner;
nothing else changes. Applied by LEAP's general plugin (``leap``), only where
the V1 runner exists and its seams check out (``vllm_ext.common.compat``).

Version guard: vLLM 0.34 removed the V1 runner, so from that release on
:func:`apply` does nothing and :func:`loading_runner` stays None (the LEAP
loader does not even ask there); a release before it still needs its V1
runner files, which an install of 0.34's code lacks whatever its metadata says.
"""

from __future__ import annotations

import contextvars
import functools
import importlib

from vllm_ext.common import compat

# the V1 runner classes whose own load_model a worker calls (the CPU runner overrides it)
TARGETS = (
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner"),
    ("vllm.v1.worker.cpu_model_runner", "CPUModelRunner"),
)
_MARK = "_vllm_ext_publishes_runner"
_LOADING: contextvars.ContextVar = contextvars.ContextVar("vllm_ext_loading_runner", default=None)


def loading_runner():
    """The V1 runner whose ``load_model`` is running in this context, else None."""
    return _LOADING.get()


def in_guarded_releases() -> bool:
    """Whether the installed vLLM predates the removal of the V1 runner (vLLM 0.34)."""
    series = compat.parse_series(compat.installed_vllm_version() or "")
    return series is not None and series < compat.V1_REMOVED_IN and compat.has_v1_runner()


def needed() -> bool:
    """True where the V1 runner exists and every LEAP V1 seam holds."""
    return in_guarded_releases() and not compat.problems("leap", runner="v1")


def _classes() -> list[type]:
    found = []
    for module, name in TARGETS:
        try:
            found.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            continue
    return found


def _publishing(load_model):
    @functools.wraps(load_model)
    def wrapper(self, *args, **kwargs):
        token = _LOADING.set(self)
        try:
            return load_model(self, *args, **kwargs)
        finally:
            _LOADING.reset(token)

    setattr(wrapper, _MARK, load_model)
    return wrapper


def _own(cls: type):
    return cls.__dict__.get("load_model")


def is_applied() -> bool:
    classes = [cls for cls in _classes() if _own(cls) is not None]
    return bool(classes) and all(hasattr(_own(cls), _MARK) for cls in classes)


def apply() -> bool:
    """Wrap each V1 runner class's own ``load_model`` once; whether the handle is active."""
    if not needed():
        return False
    for cls in _classes():
        original = _own(cls)
        if original is not None and not hasattr(original, _MARK):
            cls.load_model = _publishing(original)
    return True


def revert() -> None:
    for cls in _classes():
        original = getattr(_own(cls), _MARK, None)
        if original is not None:
            cls.load_model = original
