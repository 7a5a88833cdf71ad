"""pytest plugin (``-p tests.mutants.plugin``): swap in the mutant named by ``$MUTANT_VLLM_EXT``.

It swaps at import, while pytest reads its options: before any conftest or test
module imports the decision (some import it by name).
"""

from __future__ import annotations

import os

from tests.mutants.patching import ENV, install

if os.environ.get(ENV):
    install(os.environ[ENV])


def pytest_report_header(config):
    name = os.environ.get(ENV)
    return f"vllm_ext mutant: {name}" if name else None
