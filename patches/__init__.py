"""Registered, version-guarded patches to vLLM (installed as ``vllm_ext.patches``).

Each module patches one thing vLLM offers no seam for and exposes ``apply()``
(idempotent), ``is_applied()`` and a version guard; ``README.md`` is the
register (why, how, when applied, upstream status, removal plan). Nothing here
runs at import time.
"""
