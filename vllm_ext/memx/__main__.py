"""``python -m vllm_ext.memx`` = ``vllm-ext memx``."""

import sys

from vllm_ext.memx.cli import main

if __name__ == "__main__":
    sys.exit(main())
