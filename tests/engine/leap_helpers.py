"""Helpers for the LEAP engine tests: engines with LEAP enabled, schedule traces, weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from vllm_ext.leap.calibrate import engine_kwargs
from vllm_ext.leap.predictor import LinearLengthModel


def hf_hidden_state(model: str, prompt: list[int], layer: int) -> np.ndarray:
    """transformers' (fp32) residual stream after decoder ``layer`` at the last prompt token."""
    import torch
    from transformers import AutoModelForCausalLM

    from vllm_ext.assets import model_path

    hf = AutoModelForCausalLM.from_pretrained(model_path(model), dtype=torch.float32)
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), output_hidden_states=True)
    # hidden_states[0] is the embedding output; [l + 1] is decoder layer l's output
    return out.hidden_states[layer + 1][0, -1].numpy()


def leap_engine_kwargs(leap: dict | None = None, **overrides) -> dict:
    kwargs = engine_kwargs(leap or {}, kv_cache_bytes=128 << 20)
    kwargs.pop("max_model_len")
    kwargs.update(overrides)
    return kwargs


def scheduler_of(llm):
    """The EngineCore scheduler of an in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) engine."""
    return llm.llm_engine.engine_core.engine_core.scheduler


def leap_connector_of(llm):
    from vllm_ext.leap.scheduler import find_leap_connector

    return find_leap_connector(scheduler_of(llm).connector)


def record_schedule(llm) -> list[list[tuple[str, int]]]:
    """Wrap the scheduler so every step's (external request id, tokens) list is recorded."""
    scheduler = scheduler_of(llm)
    trace: list[list[tuple[str, int]]] = []
    original = scheduler.schedule

    def schedule(*args, **kwargs):
        out = original(*args, **kwargs)
        # internal ids are "<external>-<random suffix>"
        trace.append(
            sorted((rid.rsplit("-", 1)[0], n) for rid, n in out.num_scheduled_tokens.items())
        )
        return out

    scheduler.schedule = schedule
    return trace


def write_weights(
    path: Path,
    dim: int,
    *,
    constant: float | None = None,
    seed: int = 0,
    nan: bool = False,
    overflow: bool = False,
) -> Path:
    """A weights file of the right dimension: random ridge fit, constant, or poisoned.

    ``nan``: not loadable; ``overflow``: loads, but every prediction is infinite.
    """
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(64, dim))
    y = rng.integers(2, 200, size=64).astype(float)
    model = LinearLengthModel.fit_ridge(X, y)
    if constant is not None:
        model.w[:-1] = 0.0
        model.w[-1] = np.log1p(constant)
    if nan:
        model.w[0] = np.nan
    if overflow:
        model.w[:-1] = 1e308  # phi @ w overflows to inf/nan
    model.save(path)
    return path


def run_to_completion(llm, max_steps: int = 2000) -> dict[str, list[int]]:
    """Step the engine until idle; return finished outputs by external request id."""
    outputs: dict[str, list[int]] = {}
    engine = llm.llm_engine
    for _ in range(max_steps):
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
        if not engine.has_unfinished_requests():
            return outputs
    raise AssertionError(f"engine still busy after {max_steps} steps")
