"""ACCT benchmarks: ``python -m benchmarks.acct speed|quality`` (see __main__.py)."""
