"""On ``PYTHONPATH`` only during ``make mutants``: every Python process the tests start
(``vllm serve``, vLLM's engine core and workers) gets the mutant named by
``$MUTANT_VLLM_EXT`` too (see tests/mutants/patching.py)."""

import os

if os.environ.get("MUTANT_VLLM_EXT"):
    from tests.mutants.patching import install

    install(os.environ["MUTANT_VLLM_EXT"])
