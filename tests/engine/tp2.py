"""Tensor parallel 2 on vLLM's CPU engine: the marker's rule and a shared engine builder.

vLLM 0.32's CPU engine runs TP=2 as two worker processes (multiproc executor),
one per core; it binds each worker's OpenMP threads to the cores named in
``VLLM_CPU_OMP_THREADS_BIND`` (``"0|1"``) and refuses TP=2 without it ("Not
enough allowed NUMA nodes to bind threads of 2 local CPUWorkers"). With
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (tests/conftest.py) EngineCore and its
scheduler stay in the test process, so tests read them as at TP=1; only the
workers are separate processes.

Use (one engine per module, shared by its tests; tests marked ``tp2`` skip on
a machine with fewer than two usable CPUs)::

    pytestmark = pytest.mark.tp2

    @pytest.fixture(scope="module")
    def llm():
        with tp2_engine("tiny-llama", dtype="float32") as llm:
            yield llm
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

TP = 2
BIND_VARIABLE = "VLLM_CPU_OMP_THREADS_BIND"


def usable_cpus() -> list[int]:
    """The CPUs this process may run on (its affinity mask, not the machine's core count)."""
    return sorted(os.sched_getaffinity(0))


def thread_binding() -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` with one usable CPU per worker: ``"0|1"``."""
    return "|".join(str(cpu) for cpu in usable_cpus()[:TP])


@contextmanager
def tp2_engine(model: str | Path, **kwargs) -> Iterator:
    """An in-process ``vllm.LLM`` at tensor parallel 2 (two CPU workers); freed on exit.

    Same arguments as :func:`tests.helpers.engine` (which this wraps); the
    workers are bound one per usable CPU unless ``VLLM_CPU_OMP_THREADS_BIND``
    is already set.
    """
    from tests.helpers import engine

    previous = os.environ.get(BIND_VARIABLE)
    os.environ[BIND_VARIABLE] = previous or thread_binding()
    try:
        kwargs = {"tensor_parallel_size": TP, "distributed_executor_backend": "mp", **kwargs}
        with engine(model, **kwargs) as llm:
            try:
                yield llm
            finally:
                # stop the worker processes now, not whenever the engine is collected
                llm.llm_engine.engine_core.shutdown()
    finally:
        if previous is None:
            os.environ.pop(BIND_VARIABLE, None)
        else:
            os.environ[BIND_VARIABLE] = previous
