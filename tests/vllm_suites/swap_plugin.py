"""pytest plugin for vLLM's own test suites, run with one of our classes swapped in.

Loaded by :mod:`runner` as ``-p swap_plugin`` in a pytest process whose rootdir is
a vLLM release's unpacked sdist (``.vllm-releases/<version>``). At import, before
vLLM's conftest resolves any model, it makes this CPU host able to build that
release's configs (:mod:`release_shim`), then installs the swaps named in
``VLLM_EXT_SWAP`` (comma-separated): module ``swap_<name>`` next to this file,
whose ``install()`` puts our class where vLLM's tests build theirs.
"""

from __future__ import annotations

import importlib
import os

import release_shim

release_shim.allow_cpu_without_triton()
for _name in filter(None, os.environ.get("VLLM_EXT_SWAP", "").split(",")):
    importlib.import_module(f"swap_{_name}").install()
