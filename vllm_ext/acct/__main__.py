"""``python -m vllm_ext.acct train|eval``: see :mod:`vllm_ext.acct.cli`."""

import sys

from vllm_ext.acct.cli import main

if __name__ == "__main__":
    sys.exit(main())
