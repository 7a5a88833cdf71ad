"""Systems that cannot run on several ranks refuse ``vllm serve`` before vLLM starts, in a line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from vllm_ext.common import parallel_gate, systems
from vllm_ext.common.parallel_gate import parallel_sizes, refusal

ACCT = ["--kv-transfer-config", '{"kv_connector": "AcctConnector", "kv_role": "kv_both"}']
ARK = ["--kv-transfer-config.kv_connector_module_path", "vllm_ext.ark.connector"]
FLIDE = ["--worker-extension-cls", "vllm_ext.flide.worker.FlideWorkerExtension"]
LEAP = ["--load-format", "leap", "--scheduler-cls", "vllm_ext.leap.scheduler.make_scheduler"]
# every spelling vLLM's parser takes
TP2 = [["--tensor-parallel-size", "2"], ["-tp", "2"], ["--tensor-parallel-size=2"],
       ["--tensor_parallel_size", "2"], ["-tp=2"]]  # fmt: skip
PP2 = [["--pipeline-parallel-size", "2"], ["-pp", "2"], ["--pipeline-parallel-size=2"]]


@pytest.mark.parametrize("layout", TP2 + PP2, ids=" ".join)
def test_sizes_are_read_in_every_spelling(layout):
    tensor = layout in TP2
    assert parallel_sizes(["m", *layout]) == ((2, 1) if tensor else (1, 2))
    # the last value wins, as in vLLM's parser
    assert parallel_sizes(["m", "-tp", "4", *layout]) == ((2, 1) if tensor else (4, 2))


@pytest.mark.parametrize("layout", TP2 + PP2, ids=" ".join)
@pytest.mark.parametrize("system, args", [("ACCT", ACCT), ("ARK", ARK)])
def test_acct_and_ark_refuse_several_ranks_naming_why(system, args, layout):
    why = refusal(["m", *args, *layout])
    assert why is not None and why.startswith(f"{system} supports one worker")
    assert "\n" not in why
    assert refusal(["m", *args, "-tp", "1", "-pp", "1"]) is None


def _etaps_checkpoint(folder, method="etaps"):
    config = {"quantization_config": {"quant_method": method}}
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def test_etaps_checkpoints_refuse_tensor_parallel_only(tmp_path):
    ckpt = _etaps_checkpoint(tmp_path)
    why = refusal([ckpt, "-tp", "2"])
    assert why is not None and why.startswith("ETAPS checkpoints need --tensor-parallel-size 1")
    assert refusal(["--model", ckpt, "--tensor-parallel-size=2"]) == why
    assert refusal([ckpt, "-pp", "2"]) is None
    other = tmp_path / "tvq"
    other.mkdir()
    assert refusal([_etaps_checkpoint(other, "tvq"), "-tp", "2"]) is None
    assert refusal(["org/hub-model", "-tp", "2"]) is None  # not a folder: vLLM's to judge


def test_flide_refuses_pipeline_parallel_only():
    why = refusal(["m", *FLIDE, "-pp", "2"])
    assert why is not None and why.startswith("Flide needs --pipeline-parallel-size 1")
    assert refusal(["m", *FLIDE, "-tp", "2"]) is None


def test_systems_tested_at_tensor_parallel_2_pass():
    assert refusal(["m", *LEAP, *FLIDE, "-tp", "2"]) is None


@pytest.mark.parametrize("layout", [["-tp", "2"], ["--pipeline-parallel-size", "2"]])
def test_vllm_serve_plugin_check_exits_with_one_line(monkeypatch, capsys, layout):
    # what the suite's general plugin runs when vLLM loads it, before argument parsing
    monkeypatch.setattr(systems, "_validated", False)
    with pytest.raises(SystemExit) as exit_info:
        systems.validate_serve_argv(["vllm", "serve", "m", *ACCT, *layout], environ={})
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("vllm serve: error: ACCT supports one worker")
    parallel_gate.refuse_serve(["vllm", "serve", "m", *ACCT])  # one rank: nothing
    parallel_gate.refuse_serve(["pytest", "m", *ACCT, *layout])  # not `vllm serve`: nothing


@pytest.mark.parametrize("plugin, name", [("acct", "ACCT"), ("ark-prefill", "ARK")])
def test_vllm_ext_serve_dry_run_refuses(plugin, name):
    cmd = [sys.executable, "-m", "vllm_ext.cli", "serve", "m", "--plugins", plugin, "-tp", "2",
           "--dry-run"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stdout
    assert out.stderr.startswith(f"vllm-ext serve: error: {name} supports one worker")
    assert out.stderr.count("\n") == 1 and out.stdout == ""
