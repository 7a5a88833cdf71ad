import sys

from vllm_ext.acct.cli import main

sys.exit(main())
