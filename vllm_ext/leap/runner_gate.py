"""Whether LEAP's probe can map this engine's batch rows to requests. Imports no vLLM.

The probe runs on both vLLM model runners. On the V1 runner (where vLLM still
ships it and the engine runs it: the CPU build of 0.32/0.33) it reads the
runner's batch; on Model Runner V2 (the only runner from vLLM 0.34 on, and CUDA
0.33's default) it maps rows from ``start_load_kv``'s kwargs
(:class:`~vllm_ext.leap.batch_layout.V2StepLayout`), tested against 0.34's own
MRV2 code (``tests/vllm034/test_leap_mrv2_probe.py``). Neither holds when one
forward does not see the whole batch in row order: prefill context parallelism
gives each rank a partition of the batch's tokens, and microbatching
(``--enable-dbo``, ``--ubatch-size``) runs the model once per part, so the
probed layer's output holds part of the rows per call. Such an engine is
refused with one line: by LEAP's plugin in ``vllm serve`` before vLLM parses
its arguments (:func:`refuse_serve`), and by the loader before the weights load.
"""

from __future__ import annotations

from collections.abc import Sequence

from vllm_ext.common.argv import exit_serve_error, flag_values, int_or_one


def refusal(prefill_context_parallel_size: int = 1, use_ubatching: bool = False) -> str | None:
    """Why LEAP's probe cannot map this engine's rows; None when it can.

    Args:
        prefill_context_parallel_size: vLLM's ``ParallelConfig`` field of that name.
        use_ubatching: ``ParallelConfig.use_ubatching`` (DBO or ``ubatch_size > 1``).
    """
    if prefill_context_parallel_size > 1:
        return (
            "LEAP's probe cannot map rows to requests under prefill context parallelism "
            f"(--prefill-context-parallel-size {prefill_context_parallel_size}: each rank "
            "computes part of a prompt); serve LEAP with --prefill-context-parallel-size 1"
        )
    if use_ubatching:
        return (
            "LEAP's probe cannot map rows to requests when the forward is split into "
            "microbatches (--enable-dbo or --ubatch-size > 1); serve LEAP without them"
        )
    return None


def engine_refusal(parallel_config) -> str | None:
    """:func:`refusal` for a vLLM ``ParallelConfig`` (fields read where this vLLM has them)."""
    return refusal(
        getattr(parallel_config, "prefill_context_parallel_size", 1),
        bool(getattr(parallel_config, "use_ubatching", False)),
    )


def selects_leap(args: Sequence[str]) -> bool:
    """Whether ``vllm serve`` arguments enable LEAP (its load format, scheduler or connector)."""
    for i, arg in enumerate(args):
        name, has_value, value = arg.partition("=")
        if name.replace("_", "-") == "--load-format":
            if not has_value:
                value = args[i + 1] if i + 1 < len(args) else ""
            if value == "leap":
                return True
        if "vllm_ext.leap" in arg or "LeapConnector" in arg:
            return True
    return False


def argv_refusal(args: Sequence[str]) -> str | None:
    """:func:`refusal` for ``vllm serve`` arguments (after ``serve``)."""
    pcp = [int_or_one(v) for v in flag_values(args, ("--prefill-context-parallel-size", "-pcp"))]
    ubatch = [int_or_one(v) for v in flag_values(args, ("--ubatch-size",))]
    dbo = [v.lower() not in ("false", "0") for v in flag_values(args, ("--enable-dbo",))]
    return refusal(max(pcp, default=1), any(dbo) or max(ubatch, default=1) > 1)


def refuse_serve(argv: Sequence[str]) -> None:
    """In a ``vllm serve`` process that enables LEAP, exit with one line if LEAP cannot run.

    Runs where vLLM loads LEAP's general plugin, before it parses its
    arguments: exit status 2, as an argparse error.
    """
    if len(argv) < 2 or argv[1] != "serve" or not selects_leap(argv[2:]):
        return
    problem = argv_refusal(argv[2:])
    if problem is not None:
        exit_serve_error(problem)
