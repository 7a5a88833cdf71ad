"""ACCT's and ARK's connectors refuse, naming the seam, on a vLLM that lacks one of theirs.

They are loaded by ``kv_connector_module_path`` (no plugin entry point could
leave them unregistered), so the check runs first thing in ``__init__``.
"""

from __future__ import annotations

import importlib

import pytest

from vllm_ext.common import compat

CONNECTORS = [
    ("acct", "vllm_ext.acct.connector", "AcctConnector"),
    ("ark", "vllm_ext.ark.connector", "ArkConnector"),
    ("ark", "vllm_ext.ark.nixl", "ArkNixlConnector"),
]


@pytest.fixture
def fresh_checks():
    compat.require.cache_clear()
    yield
    compat.require.cache_clear()


@pytest.mark.parametrize("system, module, name", CONNECTORS, ids=[c[2] for c in CONNECTORS])
def test_a_connector_refuses_before_anything_else_when_its_seam_is_gone(
    system, module, name, monkeypatch, fresh_checks
):
    cls = getattr(importlib.import_module(module), name)
    gone = compat.Seam(system, "vllm.v1.request", "Request._gone", "attribute", "a test")
    monkeypatch.setattr(compat, "SEAMS", (*compat.SEAMS, gone))
    # no config at all: the refusal comes before the connector reads any
    line = r"vllm\.v1\.request\.Request\._gone missing \(needed: a test\)$"
    prefix = rf"^vllm_ext {system} cannot run on this vLLM: "
    with pytest.raises(compat.VllmCompatError, match=rf"{prefix}.*{line}"):
        cls(None, None, None)


@pytest.mark.parametrize("system", ["acct", "ark"])
def test_the_gate_passes_on_the_installed_vllm(system, fresh_checks):
    pytest.importorskip("vllm")
    compat.ensure(system)
