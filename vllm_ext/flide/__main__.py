"""``python -m vllm_ext.flide``: see :mod:`vllm_ext.flide.cli`."""

import sys

from vllm_ext.flide.cli import main

if __name__ == "__main__":
    sys.exit(main())
