"""Which systems refuse a multi-rank engine, decided from ``vllm serve`` arguments. Imports no vLLM.

Tested at tensor parallel 2 on vLLM's CPU engine (``docs/versions.md``):
LEAP, Flide, TVQ (and HiState, by its own tests). Refused before vLLM starts,
each with one line naming why:

- ACCT and ARK at tensor or pipeline parallel > 1: their connectors' worker
  halves move one worker's whole KV cache (ACCT writes converted keys and
  values for every head; ARK sends and receives every block through one
  transport), so each rank would hold or ship the wrong heads.
- ETAPS checkpoints at tensor parallel > 1: the compact row-sparse format
  (per row, the columns it keeps) cannot be cut by input column, which
  row-parallel layers need.
- Flide at pipeline parallel > 1: its packed pass runs every decoder layer
  in one call, on one rank.

:func:`refusal` reads the arguments after ``serve``; :func:`refuse_serve`
applies it in a ``vllm serve`` process (from the suite's general plugin,
before vLLM parses its arguments) and ``vllm-ext serve`` applies it before
printing its command. The connectors keep their own checks for engines
started otherwise (an offline ``LLM``, a ``--config`` file).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from vllm_ext.common.argv import exit_serve_error, flag_values, int_or_one

TENSOR_FLAGS = ("--tensor-parallel-size", "-tp")
PIPELINE_FLAGS = ("--pipeline-parallel-size", "-pp")


def _size(args: Sequence[str], names: tuple[str, ...]) -> int:
    values = flag_values(args, names)
    return int_or_one(values[-1]) if values else 1


def parallel_sizes(args: Sequence[str]) -> tuple[int, int]:
    """``(tensor, pipeline)`` parallel sizes the arguments ask for (1 where unset)."""
    return _size(args, TENSOR_FLAGS), _size(args, PIPELINE_FLAGS)


def _mentions(args: Sequence[str], *needles: str) -> bool:
    return any(needle in arg for arg in args for needle in needles)


def _model(args: Sequence[str]) -> str | None:
    """The model ``vllm serve`` would load: its positional argument or ``--model``."""
    given = flag_values(args, ("--model",))
    if given:
        return given[-1]
    return args[0] if args and not args[0].startswith("-") else None


def _quant_method(model: str | None) -> str | None:
    """``quantization_config.quant_method`` of a local checkpoint folder, else None."""
    if model is None:
        return None
    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return None  # a hub id or an unreadable folder: vLLM reports it
    quant = config.get("quantization_config") if isinstance(config, dict) else None
    return quant.get("quant_method") if isinstance(quant, dict) else None


def refusal(args: Sequence[str]) -> str | None:
    """Why a system these ``vllm serve`` arguments select cannot run on this many ranks."""
    tp, pp = parallel_sizes(args)
    if tp == pp == 1:
        return None
    layout = f"--tensor-parallel-size {tp} --pipeline-parallel-size {pp}"
    if _mentions(args, "AcctConnector", "vllm_ext.acct"):
        return (
            f"ACCT supports one worker, got {layout}: its connector writes converted KV for "
            "every head into one worker's cache; serve ACCT with tensor and pipeline parallel 1"
        )
    if _mentions(args, "ArkConnector", "vllm_ext.ark"):
        return (
            f"ARK supports one worker, got {layout}: its connector sends every KV block of "
            "the model through one worker's transport; serve ARK with tensor and pipeline "
            "parallel 1"
        )
    quantization = (_quant_method(_model(args)), *flag_values(args, ("--quantization", "-q")))
    if tp > 1 and "etaps" in quantization:
        return (
            f"ETAPS checkpoints need --tensor-parallel-size 1, got {tp}: the compact row-sparse "
            "format cannot be split by input column, as row-parallel layers need"
        )
    if pp > 1 and _mentions(args, "vllm_ext.flide"):
        return (
            f"Flide needs --pipeline-parallel-size 1, got {pp}: its packed pass runs every "
            "decoder layer in one call on one rank"
        )
    return None


def refuse_serve(argv: Sequence[str]) -> None:
    """In a ``vllm serve`` process, exit with one line (status 2) if :func:`refusal` says so."""
    if len(argv) < 2 or argv[1] != "serve":
        return
    problem = refusal(argv[2:])
    if problem is not None:
        exit_serve_error(problem)
