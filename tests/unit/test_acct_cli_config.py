"""ACCT config and the train/eval CLI end to end on the tiny-llama asset (no vLLM)."""

from __future__ import annotations

import json

import pytest

from vllm_ext.acct import checkpoint as ckpt
from vllm_ext.acct.cli import main
from vllm_ext.acct.config import AcctConfig, from_additional_config, load_acct_config
from vllm_ext.common.config import ConfigError, env_var_name


def test_config_from_additional_config_and_env():
    cfg = from_additional_config({"acct": {"checkpoint": "/ck", "check_tokens": 0}})
    assert cfg == AcctConfig(checkpoint="/ck", check_tokens=0)
    env = {env_var_name("acct", "min_prefix_tokens"): "64"}
    assert load_acct_config({}, env).min_prefix_tokens == 64
    assert from_additional_config(None) == AcctConfig()


@pytest.mark.parametrize(
    "block, match",
    [
        ({"checkpont": "x"}, "unknown key 'checkpont'.*valid: check_max_gap, check_tokens"),
        ({"min_prefix_tokens": 0}, "min_prefix_tokens must be >= 1"),
        ({"min_top1": 1.5}, r"min_top1 must be in \[0, 1\]"),
        ({"check_tokens": -1}, "check_tokens must be >= 0"),
        ({"max_delta_nll": "a lot"}, "max_delta_nll must be float"),
    ],
)
def test_bad_config_names_the_key(block, match):
    with pytest.raises(ConfigError, match=match):
        from_additional_config({"acct": block})


def test_train_resume_eval_and_gate(tmp_path, capsys):
    out = tmp_path / "ck"
    args = ["train", "--model", "tiny-llama", "--out", str(out), "--source-layers", "1",
            "--context", "64", "--continuation", "8", "--conversations", "3",
            "--ridge-windows", "2", "--steps", "2", "--checkpoint-every", "1"]  # fmt: skip
    assert main(args) == 0
    assert ckpt.read_meta(out).trained["steps"] == 2
    assert main([*args[:-4], "--steps", "3", "--checkpoint-every", "1"]) == 0
    assert "resumed at step 2" in capsys.readouterr().err
    assert ckpt.read_meta(out).trained["steps"] == 3
    with pytest.raises(ValueError, match="other settings"):
        main([*args[:-4], "--steps", "4", "--lr", "0.5"])
    gate_args = ["eval", "--model", "tiny-llama", "--checkpoint", str(out), "--windows", "2",
                 "--context", "64", "--continuation", "16", "--write-gate",
                 "--json", str(tmp_path / "r.json")]  # fmt: skip
    assert main(gate_args) == 0
    printed = json.loads(capsys.readouterr().out)
    gate = ckpt.read_meta(out).gate
    assert gate == printed["gate"] and gate["windows"] == 2 and gate["source_layers"] == 1
    assert set(printed["means"]) == {"own", "acct", "truncated", "no_context"}
    full = json.loads((tmp_path / "r.json").read_text())
    assert len(full["windows"]) == 2
    with pytest.raises(SystemExit, match="exact by construction"):
        main(["eval", "--model", "tiny-llama", "--checkpoint", "identity", "--windows", "1",
              "--context", "64", "--continuation", "8", "--write-gate"])  # fmt: skip
