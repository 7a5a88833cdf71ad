"""Version gate and vLLM-style logging."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest

from vllm_ext.common import compat, compat_check, compat_doc, compat_scan
from vllm_ext.common.log import get_logger


@pytest.mark.parametrize(
    "version, ok",
    [("0.32.0", True), ("0.32.0+cpu", True), ("0.34.0", True), ("0.32.3", False),
     ("0.35.0", False), ("garbage", False), (None, False)],
)  # fmt: skip
def test_checked_releases(version, ok):
    assert compat.is_checked(version) is ok


def test_every_seam_is_well_formed_and_each_system_declares_its_own():
    for seam in compat.SEAMS:
        assert seam.kind in compat.KINDS and seam.why and seam.runner in ("", "v1", "v2"), seam
        assert seam.module and seam.qualname, seam
        if seam.kind in ("source", "call"):
            assert seam.params, seam
        assert (seam.kind == "call") == bool(seam.ours), seam
        if seam.ours:
            assert seam.ours.startswith("vllm_ext.") and ":" in seam.ours, seam
    names = [(s.system, s.name, s.ours, s.releases) for s in compat.SEAMS]
    assert len(names) == len(set(names)), "a seam is listed twice for one system"
    systems = {"common", "leap", "histate", "flide", "ark", "acct", "tvq", "etaps"}
    assert set(compat.SYSTEMS) == systems
    # each system's seams.py declares only its own entries
    for system in compat.SYSTEMS:
        module = importlib.import_module(f"vllm_ext.{system}.seams")
        assert {s.system for s in module.SEAMS} == {system}, system
    # the private ones the review named are all in the tables
    for name in ("KVConnectorFactory._registry", "_LOAD_FORMAT_TO_MODEL_LOADER",
                 "Scheduler._preempt_request", "BlockPool._maybe_evict_cached_block",
                 "QwenGatedDeltaNetAttention._output_projection", "Module._modules",
                 "REGISTRY._collector_to_names", "REGISTRY._names_to_collectors",
                 "KVConnectorBase_V1._kv_cache_manager",
                 "KVConnectorPromMetrics._counter_cls"):  # fmt: skip
        assert any(s.name.endswith(name) and s.private for s in compat.SEAMS), name


def test_the_call_that_broke_histate_on_0_33_is_declared():
    calls = {(s.qualname, s.params[0]): s.ours for s in compat.seams_of("histate")
             if s.kind == "call"}  # fmt: skip
    assert calls[("CPUOffloadingManager.prepare_store", "self._policy.insert")] == (
        "vllm_ext.histate.cache_policy:HiStateCachePolicy.insert"
    )


def test_a_serve_command_selects_systems_by_its_words():
    argv = ["--kv-transfer-config", '{"kv_connector": "AcctConnector"}', "--load-format=leap"]
    assert compat.selected_systems(argv) == ["acct", "leap"]
    assert compat.selected_systems(["--quantization", "tvq", "--port", "8000"]) == ["tvq"]
    assert compat.selected_systems(["--model", "m"]) == []


def test_check_instance_names_the_attribute():
    class Scheduler:
        running = []

    with pytest.raises(compat.VllmCompatError, match=r"Scheduler\.waiting missing on Scheduler"):
        compat.check_instance("leap", Scheduler(), "Scheduler")


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
        "assert 'vllm_ext.etaps.linear_method' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# every vllm.general_plugins entry point of pyproject.toml, called twice (vLLM calls them in
# every process), then what each must have put in vLLM's registries, resolved by vLLM itself
_REGISTERED = """
from vllm_ext import plugin
from vllm_ext.histate import plugin as histate_plugin
from vllm_ext.leap import plugin as leap_plugin
from vllm_ext.tvq import plugin as tvq_plugin
for register in (plugin.register, leap_plugin.register, tvq_plugin.register,
                 histate_plugin.register) * 2:
    register()
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.model_executor import model_loader
from vllm.model_executor.layers.quantization import get_quantization_config
from vllm.v1.kv_offload.cpu.policies.factory import CachePolicyFactory
print(KVConnectorFactory.get_connector_class_by_name("LeapConnector").__module__)
print(model_loader._LOAD_FORMAT_TO_MODEL_LOADER["leap"].__module__)
print(get_quantization_config("tvq").__module__)
print(get_quantization_config("etaps").__module__)
print(CachePolicyFactory.get_cache_policy_cls("histate").__module__)
"""


def test_plugin_entry_points_register_our_classes_in_vllms_registries():
    pytest.importorskip("vllm")
    out = subprocess.run([sys.executable, "-c", _REGISTERED], capture_output=True, text=True,
                         check=True, env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"})  # fmt: skip
    modules = out.stdout.split()[-5:]
    assert modules == ["vllm_ext.leap.connector", "vllm_ext.leap.loader",
                       "vllm_ext.tvq.linear_method", "vllm_ext.etaps.linear_method",
                       "vllm_ext.histate.cache_policy"], out.stdout + out.stderr  # fmt: skip


def test_every_module_that_imports_vllm_is_an_adapter_the_check_imports():
    """The scan finds each module a plain text search says imports vLLM, and those it
    imports through a patch (histate.device_pool), so none goes unchecked."""
    import re

    adapters = set(compat_scan.adapters())
    pattern = re.compile(r"^\s*(from vllm[ .]|import vllm\b)", re.M)
    for path in compat_scan.PACKAGE.rglob("*.py"):
        if pattern.search(path.read_text()):
            module = ".".join(path.relative_to(compat_scan.REPO).with_suffix("").parts)
            assert module.removesuffix(".__init__") in adapters, module
    for module in ("vllm_ext.ark.nixl", "vllm_ext.common.quantization_config",
                   "vllm_ext.etaps.linear_method", "vllm_ext.histate.cache_policy",
                   "vllm_ext.histate.device_pool", "vllm_ext.tvq.linear_method"):  # fmt: skip
        assert module in adapters, module


def test_docs_compat_md_agrees_with_the_checks_on_every_release():
    """Reruns the import-level check on vLLM 0.32 (installed), 0.33 and 0.34 (their
    source trees), each in its own process, and compares the rendered doc."""
    pytest.importorskip("vllm")
    for version in compat_check.RELEASES[1:]:
        if not (compat_check.REPO / ".vllm-releases" / version / ".complete").exists():
            pytest.skip(f"vLLM {version}'s sdist is not unpacked: make releases")
    reports = compat_check.check_releases()
    assert [r["vllm"] for r in reports] == list(compat_check.RELEASES)
    assert compat_doc.render(reports) == compat_check.DOC.read_text(), (
        f"docs/compat.md disagrees with the checks: run `{compat_doc.REGENERATE}`"
    )
