"""Version gate and vLLM-style logging."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from vllm_ext.common import compat
from vllm_ext.common.log import get_logger


@pytest.mark.parametrize(
    "version, ok",
    [
        ("0.32.0", True),
        ("0.32.3+cpu", True),
        ("0.31.9", False),
        ("0.33.0", False),
        ("1.32.0", False),
        ("garbage", False),
        (None, False),
    ],
)
def test_supported_series(version, ok):
    assert compat.is_supported(version) is ok


class _ListHandler(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


def test_unsupported_vllm_warns_once_and_registers_nothing(monkeypatch):
    monkeypatch.setattr(compat, "installed_vllm_version", lambda: "0.31.0")
    handler = _ListHandler()
    compat.logger.addHandler(handler)
    compat.supported_vllm.cache_clear()
    try:
        assert compat.supported_vllm() is False
        assert compat.supported_vllm() is False
    finally:
        compat.logger.removeHandler(handler)
        compat.supported_vllm.cache_clear()
    messages = [r.getMessage() for r in handler.records]
    assert messages == [
        "vllm_ext supports vLLM 0.32.x but found 0.31.0; vllm_ext registers nothing "
        "and vLLM runs unchanged."
    ]


def test_installed_vllm_is_supported():
    pytest.importorskip("vllm")
    assert compat.is_supported(compat.installed_vllm_version())


def test_logger_lives_in_vllm_namespace():
    assert get_logger("vllm_ext.x.y").name == "vllm.vllm_ext.x.y"
    assert get_logger("vllm.vllm_ext.x").name == "vllm.vllm_ext.x"


def test_records_use_vllm_format_and_level():
    pytest.importorskip("vllm")
    code = (
        "from vllm.config import LoggingConfig\n"
        "from vllm.logger import configure_logging\n"
        "configure_logging(LoggingConfig())  # what every engine does at start\n"
        "from vllm_ext.common.log import get_logger\n"
        "log = get_logger('vllm_ext.demo')\n"
        "log.info('hello %s', 'info')\n"
        "log.debug('hidden %d', 1)\n"
        "log.warning_once('once')\n"
        "log.warning_once('once')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={"VLLM_LOGGING_LEVEL": "INFO", "PATH": ""},
        check=True,
    )
    text = out.stdout + out.stderr
    assert "INFO" in text and "hello info" in text
    assert "hidden" not in text
    assert text.count("once") == 1


def test_plugin_entry_point_is_reentrant_and_imports_no_vllm():
    code = (
        "import sys; sys.modules['vllm'] = None\n"
        "from vllm_ext.plugin import register\n"
        "register(); register()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
