"""Offline model assets for tests, benchmarks and the demo (``python -m vllm_ext.assets``)."""

from vllm_ext.assets.models import MODELS, leap_weights_path, model_path
from vllm_ext.assets.store import cache_dir

__all__ = ["MODELS", "cache_dir", "leap_weights_path", "model_path"]
