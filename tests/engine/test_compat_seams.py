"""The compat table against the installed vLLM: every seam holds, a broken one is named."""

from __future__ import annotations

import logging

import pytest

from vllm_ext.common import compat


class _ListHandler(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


def test_every_seam_holds_on_the_installed_vllm():
    pytest.importorskip("vllm")
    runner = None if compat.has_v1_runner() else "v2"
    for system in ("common", "leap", "histate", "flide", "ark", "acct"):
        assert compat.problems(system, runner) == [], system


def test_a_missing_or_reshaped_seam_is_named_with_the_version(monkeypatch):
    pytest.importorskip("vllm")
    gone = compat.Seam("leap", "vllm.v1.core.sched.scheduler", "Scheduler._gone", "symbol", "x")
    reshaped = compat.Seam(
        "leap", "vllm.v1.core.sched.scheduler", "Scheduler._preempt_request", "signature", "y",
        ("request", "when"),
    )  # fmt: skip
    monkeypatch.setattr(compat, "SEAMS", (gone, reshaped))
    lines = compat.problems("leap")
    version = compat.installed_vllm_version()
    assert lines[0] == (
        f"vLLM {version}: vllm.v1.core.sched.scheduler.Scheduler._gone missing (needed: x)"
    )
    assert lines[1].startswith(f"vLLM {version}: vllm.v1.core.sched.scheduler.Scheduler.")
    assert "expected (request, when, ...)" in lines[1]


def test_unchecked_vllm_warns_once_and_a_broken_seam_disables(monkeypatch):
    pytest.importorskip("vllm")
    monkeypatch.setattr(compat, "installed_vllm_version", lambda: "0.35.0")
    broken = compat.Seam("common", "vllm.plugins", "NO_SUCH_GROUP", "symbol", "z")
    monkeypatch.setattr(compat, "SEAMS", (broken,))
    handler = _ListHandler()
    compat.logger.addHandler(handler)
    compat.supported_vllm.cache_clear()
    compat.require.cache_clear()
    try:
        assert compat.supported_vllm() is False
        assert compat.supported_vllm() is False
    finally:
        compat.logger.removeHandler(handler)
        compat.supported_vllm.cache_clear()
        compat.require.cache_clear()
    messages = [r.getMessage() for r in handler.records]
    assert messages == [
        "vllm_ext was checked against vLLM 0.32.0, 0.33.0, 0.34.0 but found 0.35.0; its seams "
        "are checked at load",
        "vllm_ext common disabled: vLLM 0.35.0: vllm.plugins.NO_SUCH_GROUP missing (needed: z)",
    ]


def test_locate_follows_a_moved_symbol():
    pytest.importorskip("vllm")
    assert callable(compat.locate("flide", "chunk_gated_delta_rule_cpu"))
    with pytest.raises(KeyError):
        compat.locate("flide", "nothing")
