"""The seam tables against the installed vLLM: all hold; a broken one refuses in one line."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_ext.common import compat
from vllm_ext.common.seam import Seam

REPO = Path(__file__).resolve().parents[2]
_MGR = "vllm.v1.kv_offload.cpu.manager"
_POLICY = "vllm_ext.histate.cache_policy:HiStateCachePolicy"
HISTATE_SERVE = ["vllm", "serve", "m", "--kv-transfer-config",
                 '{"kv_connector": "HiStateConnector"}']  # fmt: skip


class _ListHandler(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture
def fresh_gate():
    compat.require.cache_clear()
    compat.supported_vllm.cache_clear()
    yield
    compat.require.cache_clear()
    compat.supported_vllm.cache_clear()


def test_every_seam_of_every_system_holds_on_the_installed_vllm():
    pytest.importorskip("vllm")
    runner = None if compat.has_v1_runner() else "v2"
    assert {"tvq", "etaps", "acct", "ark"} <= set(compat.SYSTEMS)
    for system in compat.SYSTEMS:
        assert compat.problems(system, runner if system == "leap" else None) == [], system


def test_a_missing_or_reshaped_seam_is_named_with_the_version(monkeypatch):
    pytest.importorskip("vllm")
    gone = Seam("leap", "vllm.v1.core.sched.scheduler", "Scheduler._gone", "symbol", "x")
    reshaped = Seam(
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


def test_a_call_our_override_cannot_take_is_found_in_vllms_source(monkeypatch):
    """vLLM's manager calls ``on_request_finished`` with four arguments: an override that
    takes one (``mark_evictable``, standing in for a stale one) must fail the check."""
    pytest.importorskip("vllm")
    holds = Seam("histate", _MGR, "CPUOffloadingManager.on_request_finished", "call", "w",
                 ("self._policy.on_request_finished",), ours=f"{_POLICY}.on_request_finished")
    stale = Seam("histate", _MGR, "CPUOffloadingManager.on_request_finished", "call", "w",
                 ("self._policy.on_request_finished",), ours=f"{_POLICY}.mark_evictable")
    gone = Seam("histate", _MGR, "CPUOffloadingManager.on_request_finished", "call", "w",
                ("self._policy.no_such_call",), ours=f"{_POLICY}.insert")  # fmt: skip
    assert compat.seam_problem(holds) is None
    assert compat.seam_problem(stale) == (
        "with (4 positional), which our HiStateCachePolicy.mark_evictable cannot take "
        "(too many positional arguments)"
    )
    assert compat.seam_problem(gone) == "no longer calls self._policy.no_such_call"


def test_a_broken_seam_refuses_vllm_serve_in_one_line(monkeypatch, capsys, fresh_gate):
    pytest.importorskip("vllm")
    broken = Seam("histate", _MGR, "CPUOffloadingManager.on_request_finished", "call", "w",
                  ("self._policy.on_request_finished",), ours=f"{_POLICY}.mark_evictable")
    monkeypatch.setattr(compat, "SEAMS", (*compat.SEAMS, broken))
    compat.refuse_serve(["vllm", "serve", "m"])  # histate not selected: nothing happens
    with pytest.raises(SystemExit) as exit_:
        compat.refuse_serve(HISTATE_SERVE)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("vllm serve: error: vllm_ext histate cannot run on this vLLM: vLLM ")
    assert "HiStateCachePolicy.mark_evictable cannot take" in err
    # outside `vllm serve` (an offline LLM) the connector refuses to build, in one line
    with pytest.raises(compat.VllmCompatError, match="vllm_ext histate cannot run"):
        compat.ensure("histate")


def test_the_plugin_refuses_before_vllm_parses_its_arguments():
    """vLLM loads general plugins before it parses ``vllm serve``'s arguments: the suite's
    plugin is where a selected system with a broken seam stops the process."""
    pytest.importorskip("vllm")
    code = (
        "import sys\n"
        "from vllm_ext.common import compat\n"
        "from vllm_ext.common.seam import Seam\n"
        "compat.SEAMS += (Seam('acct', 'vllm.v1.core.sched.scheduler', 'Scheduler._gone',"
        " 'symbol', 'z'),)\n"
        "sys.argv = ['vllm', 'serve', 'm', '--kv-transfer-config',"
        " '{\"kv_connector\": \"AcctConnector\"}']\n"
        "from vllm_ext.plugin import register\n"
        "register()\n"
        "print('vLLM would start now')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 2
    assert "vLLM would start now" not in out.stdout
    line = [x for x in out.stderr.splitlines() if x.startswith("vllm serve: error:")]
    assert line == [
        "vllm serve: error: vllm_ext acct cannot run on this vLLM: vLLM "
        f"{compat.installed_vllm_version()}: vllm.v1.core.sched.scheduler.Scheduler._gone "
        "missing (needed: z)"
    ]


def test_unchecked_vllm_warns_once_and_a_broken_seam_disables(monkeypatch, fresh_gate):
    pytest.importorskip("vllm")
    monkeypatch.setattr(compat, "installed_vllm_version", lambda: "0.35.0")
    broken = Seam("common", "vllm.plugins", "NO_SUCH_GROUP", "symbol", "z")
    monkeypatch.setattr(compat, "SEAMS", (broken,))
    handler = _ListHandler()
    compat.logger.addHandler(handler)
    try:
        assert compat.supported_vllm() is False
        assert compat.supported_vllm() is False
    finally:
        compat.logger.removeHandler(handler)
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


def test_instance_entries_hold_on_0_32s_real_objects():
    """tests/vllm034/test_compat_instances.py against 0.32: the installed code, and 0.32's
    own test helpers (``create_scheduler``) from its sdist."""
    pytest.importorskip("vllm")
    code = (
        "import importlib.util, sys\n"
        f"sys.path.insert(1, {str(REPO / 'tests')!r})\n"
        "import release_shim\n"
        f"release_shim.use_offline_hub(__import__('pathlib').Path({str(REPO)!r}) /"
        " '.vllm-releases' / 'hub')\n"
        "spec = importlib.util.spec_from_file_location('compat_instances',"
        f" {str(REPO / 'tests/vllm034/test_compat_instances.py')!r})\n"
        "mod = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(mod)\n"
        "mod.test_every_instance_entry_holds_on_this_releases_objects()\n"
        "mod.test_a_missing_instance_attribute_is_named()\n"
        "print('verified', len(mod.compat.VERIFIED_INSTANCES))\n"
    )
    sdist = REPO / ".vllm-releases" / "0.32.0"
    if not (sdist / ".complete").exists():
        pytest.skip("vLLM 0.32.0's sdist is not unpacked: make releases")
    env = {**os.environ, "PYTHONPATH": f"{sdist}{os.pathsep}{REPO}",
           "VLLM_EXT_RELEASE_UNDER_TEST": "0.32.0"}  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "verified" in out.stdout


def test_every_override_of_ours_has_its_vllm_call_checked():
    """A method our classes (found by scanning) override is covered by a ``call`` entry or
    listed in its system's ``UNCALLED`` with the reason: a new override fails here until
    its call shape is declared."""
    pytest.importorskip("vllm")
    from vllm_ext.common import compat_check

    rows = compat_check.override_rows()
    assert [r["seam"] for r in rows if r["status"] == "unchecked"] == []
    assert [r for r in rows if r["status"] != "ok"] == []
    checked = {r["seam"] for r in rows}
    assert "how vLLM calls LeapRequestQueue.remove_request" in checked  # an UNCALLED one
    assert "HiStateCachePolicy.insert overrides CachePolicy.insert" in checked
