"""Loggers for vllm_ext that behave like vLLM's own.

vLLM configures one logger, ``vllm``, with its handler, format and
``VLLM_LOGGING_LEVEL``, and sets ``propagate=False``; loggers outside that
namespace lose all of it. Placing ours under ``vllm.`` gives them vLLM's format,
level and ``--logging-config`` for free, without importing vLLM here (algorithm
modules must stay importable without it).
"""

from __future__ import annotations

import logging
import sys

LOGGER_PREFIX = "vllm."


def get_logger(module_name: str) -> logging.Logger:
    """Return the logger for ``module_name`` inside vLLM's logger tree.

    Args:
        module_name: usually ``__name__`` of the calling module.

    Returns:
        ``logging.getLogger("vllm." + module_name)``; when vLLM's logger module
        is already loaded, the logger also gets vLLM's ``warning_once``-style
        helpers.
    """
    name = module_name if module_name.startswith(LOGGER_PREFIX) else LOGGER_PREFIX + module_name
    vllm_logger = sys.modules.get("vllm.logger")
    if vllm_logger is not None:
        return vllm_logger.init_logger(name)
    return logging.getLogger(name)
