"""LEAP benchmark: ``python -m benchmarks.leap`` (see __main__.py)."""
