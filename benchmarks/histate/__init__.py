"""HiState benchmarks: ``python -m benchmarks.histate.sim`` (calibrated simulator)."""
