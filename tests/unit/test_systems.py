"""The systems' config registry and whole-config validation, before vLLM starts.

`vllm-ext serve` runs for real in a subprocess: a bad config must exit with one
line before vLLM is imported (checked with ``-X importtime``, never a timing).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from vllm_ext.common import systems
from vllm_ext.common.config import ConfigError
from vllm_ext.common.systems import (
    SYSTEM_CONFIGS,
    additional_config_from_argv,
    config_class,
    config_from_vllm,
    validate_additional_config,
)
from vllm_ext.flide.config import FlideConfig
from vllm_ext.histate.config import HiStateConfig
from vllm_ext.leap.config import LeapConfig


def test_registry_names_each_systems_config_class():
    for system in SYSTEM_CONFIGS:
        cls = config_class(system)
        assert dataclasses.is_dataclass(cls)
        assert sys.modules[cls.__module__].SYSTEM == system


def test_nothing_set_builds_every_system_at_its_defaults():
    built = validate_additional_config({}, environ={})
    assert built == {system: config_class(system)() for system in SYSTEM_CONFIGS}
    assert built["leap"] == LeapConfig() and built["histate"] == HiStateConfig()
    assert built["flide"] == FlideConfig()


def test_every_block_is_built_and_other_keys_are_left_to_vllm():
    additional = {
        "leap": {"weights_path": "w.npz", "experimental": {"risk_k": 0.5}},
        "histate": {"host_bytes": 1 << 30},
        "flide": {"max_labels": 8},
        # vLLM writes this one itself; a platform plugin may add its own
        "gdn_prefill_backend": "triton",
        "ascend_scheduler_config": {"enabled": True},
    }
    env = {"VLLMEXT_FLIDE_MAX_QUESTIONS": "7", "VLLMEXT_ASSETS_DIR": "/a", "PATH": "/bin"}
    built = validate_additional_config(additional, environ=env)
    assert built["leap"] == LeapConfig(weights_path="w.npz", risk_k=0.5)
    assert built["histate"] == HiStateConfig(host_bytes=1 << 30)
    assert built["flide"] == FlideConfig(max_labels=8, max_questions=7)


@pytest.mark.parametrize(
    "key, meant",
    [("leapp", "leap"), ("LEAP", "leap"), ("HiState", "histate"), ("hi_state", "histate"),
     ("flid", "flide"), ("leap_config", "leap"), ("histate-settings", "histate")],
)  # fmt: skip
def test_a_near_miss_of_a_system_name_is_an_error(key, meant):
    with pytest.raises(ConfigError) as err:
        validate_additional_config({key: {"weights_path": "w"}}, environ={})
    message = str(err.value)
    assert f"unknown system {key!r}" in message and f"did you mean {meant!r}" in message
    assert f"systems: {', '.join(sorted(SYSTEM_CONFIGS))}" in message


def test_a_bad_key_inside_a_block_names_it_and_the_valid_ones():
    with pytest.raises(ConfigError) as err:
        validate_additional_config({"histate": {"host_byte": 1}}, environ={})
    message = str(err.value)
    assert "'host_byte'" in message and "did you mean 'host_bytes'" in message
    assert (
        "valid: allow_unsafe_directory, directory, fsync, host_bytes, policy, shared_group, "
        "ssd_bytes, experimental"
    ) in message


@pytest.mark.parametrize("additional", [[], "leap", {"leap": "w.npz"}, {"flide": [1]}])
def test_blocks_must_be_json_objects(additional):
    with pytest.raises(ConfigError, match="must be a JSON object"):
        validate_additional_config(additional, environ={})


def test_old_env_prefix_is_an_error_naming_every_new_name():
    env = {"VLLM_EXT_ASSETS_DIR": "/a", "VLLM_EXT_HISTATE_DIRECTORY": "/s"}
    with pytest.raises(ConfigError) as err:
        validate_additional_config({}, environ=env)
    message = str(err.value)
    assert "VLLM_EXT_ASSETS_DIR -> VLLMEXT_ASSETS_DIR" in message
    assert "VLLM_EXT_HISTATE_DIRECTORY -> VLLMEXT_HISTATE_DIRECTORY" in message


@pytest.mark.parametrize(
    "name, needle",
    [
        ("VLLMEXT_LEAPP_LAYER", "valid: VLLMEXT_LEAP_<FIELD>"),
        ("VLLMEXT_ASSET_DIR", "did you mean 'VLLMEXT_ASSETS_DIR'"),
        ("VLLMEXT_LEAP_LAYR", "did you mean 'VLLMEXT_LEAP_LAYER'"),
    ],
)
def test_unknown_variables_with_our_prefix_are_errors(name, needle):
    with pytest.raises(ConfigError, match=name) as err:
        validate_additional_config({}, environ={name: "1"})
    assert needle in str(err.value)


def test_config_from_vllm_reads_the_systems_block():
    vllm_config = SimpleNamespace(additional_config={"histate": {"policy": "lru"}})
    assert config_from_vllm("histate", vllm_config) == HiStateConfig(policy="lru")
    assert config_from_vllm("leap", SimpleNamespace(additional_config=None)) == LeapConfig()
    # a platform plugin's own object, not a dict: nothing of ours in it
    assert config_from_vllm("flide", SimpleNamespace(additional_config=object())) == FlideConfig()


@pytest.mark.parametrize(
    "args, expected",
    [
        ([], None),
        (["--port", "8000"], None),
        (["--additional-config", '{"leap": {"layer": 3}}'], {"leap": {"layer": 3}}),
        (['--additional_config={"flide": {}}'], {"flide": {}}),
        # the last plain value wins, as in argparse
        (["--additional-config", '{"a": 1}', "--additional-config", '{"b": 2}'], {"b": 2}),
        # dotted keys merge into one dict that replaces the plain value (vLLM 0.32)
        (
            ["--additional-config", '{"a": 1}', "--additional-config.leap.weights_path", "w.npz",
             "--additional_config.leap.experimental.risk_k=0.5",
             "--additional-config.histate.host_bytes", "8G"],
            {"leap": {"weights_path": "w.npz", "experimental": {"risk_k": 0.5}},
             "histate": {"host_bytes": 8 << 30}},
        ),
        (["--additional-config.histate.host_bytes", "1.5k"], {"histate": {"host_bytes": 1500}}),
    ],
)  # fmt: skip
def test_additional_config_is_read_from_argv_as_vllm_reads_it(args, expected):
    assert additional_config_from_argv(args) == expected


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--additional-config", "{leap: 1}"], "not valid JSON"),
        (["--additional-config", "/etc/ext.json"], "must be a JSON object"),
        (["--additional-config"], "needs a value"),
    ],
)
def test_bad_additional_config_values_are_named(args, needle):
    with pytest.raises(ConfigError, match=needle):
        additional_config_from_argv(args)


def test_serve_argv_check_exits_with_one_line(monkeypatch, capsys):
    monkeypatch.setattr(systems, "_validated", False)
    argv = ["vllm", "serve", "m", "--additional-config", '{"leap": {"weigths_path": "x"}}']
    with pytest.raises(SystemExit) as exit_info:
        systems.validate_serve_argv(argv, environ={})
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("vllm serve: error: unknown key 'weigths_path'")
    # once per process, and nothing for processes that are not `vllm serve`
    systems.validate_serve_argv(argv, environ={})
    monkeypatch.setattr(systems, "_validated", False)
    systems.validate_serve_argv(["pytest", "-x", *argv[2:]], environ={})


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    # -X importtime lists every module imported on stderr: proof that vLLM never was
    cmd = [sys.executable, "-X", "importtime", "-m", "vllm_ext.cli", "serve", "MODEL", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)


def _split_importtime(stderr: str) -> tuple[list[str], list[str]]:
    lines = stderr.splitlines()
    imported = [
        line.rsplit("|", 1)[-1].strip() for line in lines if line.startswith("import time:")
    ]
    return imported, [line for line in lines if not line.startswith("import time:")]


def test_cli_refuses_a_typo_with_one_line_before_vllm_is_imported():
    config = json.dumps({"leap": {"weigths_path": "x"}})
    result = _cli("--plugins", "leap", "--additional-config", config)
    imported, messages = _split_importtime(result.stderr)
    assert result.returncode == 2 and result.stdout == ""
    assert len(messages) == 1, messages
    assert messages[0].startswith("vllm-ext serve: error: unknown key 'weigths_path'")
    assert "did you mean 'weights_path'" in messages[0]
    for key in ("checkpoint_path", "layer", "max_wait_s", "weights_path", "experimental"):
        assert key in messages[0].split("valid:", 1)[1]
    assert "vllm_ext.common.systems" in imported
    assert not [m for m in imported if m == "vllm" or m.startswith("vllm.")], imported


def test_cli_refuses_an_old_env_var_and_accepts_a_good_config(tmp_path):
    import os

    env = {**os.environ, "VLLM_EXT_HISTATE_HOST_BYTES": "1"}
    result = _cli("--plugins", "histate", env=env)
    _, messages = _split_importtime(result.stderr)
    assert result.returncode == 2
    assert messages == [
        "vllm-ext serve: error: vllm_ext no longer reads 'VLLM_EXT_HISTATE_HOST_BYTES': rename "
        "VLLM_EXT_HISTATE_HOST_BYTES -> VLLMEXT_HISTATE_HOST_BYTES (vLLM >= 0.34 refuses "
        "unknown VLLM_* variables)"
    ]
    good = json.dumps({"histate": {"directory": str(tmp_path), "experimental": {"fsync": 0}}})
    result = _cli("--plugins", "histate", "--additional-config", good)
    assert (
        result.returncode == 2
        and "'fsync'" in result.stderr
        and "is a public key" in (result.stderr)
    )
    good = json.dumps({"histate": {"directory": str(tmp_path), "fsync": False}})
    result = _cli("--plugins", "histate", "--additional-config", good, "--dry-run")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "--additional-config" in result.stdout


def test_every_setting_that_names_an_existing_file_or_folder_is_marked():
    from vllm_ext.common.config import path_fields

    marked = {(s, f.name) for s in SYSTEM_CONFIGS for f in path_fields(config_class(s))}
    assert marked == {("leap", "weights_path"), ("leap", "refine_weights_path"),
                      ("ark", "fabric_file"), ("ark", "secret_file"), ("acct", "checkpoint")}


@pytest.mark.parametrize(
    "system, key, kind",
    [("leap", "weights_path", "file"), ("leap", "refine_weights_path", "file"),
     ("ark", "fabric_file", "file"), ("ark", "secret_file", "file"),
     ("acct", "checkpoint", "folder")],
)  # fmt: skip
def test_a_missing_path_is_one_line_before_vllm_and_an_existing_one_passes(
    tmp_path, system, key, kind
):
    missing = str(tmp_path / "missing")
    config = json.dumps({system: {key: missing}})
    result = _cli("--plugins", system, "--additional-config", config, "--dry-run")
    imported, messages = _split_importtime(result.stderr)
    assert result.returncode == 2 and result.stdout == ""
    assert messages == [
        f'vllm-ext serve: error: additional_config["{system}"].{key}: no such {kind} {missing!r}'
    ]
    assert not [m for m in imported if m == "vllm" or m.startswith("vllm.")], imported
    # the same check under plain `vllm serve`, from the general plugin (before vLLM parses)
    existing = tmp_path / "there"
    existing.mkdir() if kind == "folder" else existing.write_text("x")
    configs = validate_additional_config({system: {key: str(existing)}}, environ={})
    systems.check_config_paths(configs)
    configs = validate_additional_config({system: {key: missing}}, environ={})
    with pytest.raises(ConfigError, match="no such"):
        systems.check_config_paths(configs)


def test_acct_identity_is_not_a_path_and_a_relative_path_names_the_folder_it_was_read_in():
    systems.check_config_paths(validate_additional_config({"acct": {"checkpoint": "identity"}},
                                                          environ={}))  # fmt: skip
    configs = validate_additional_config({"leap": {"weights_path": "w.npz"}}, environ={})
    with pytest.raises(ConfigError, match=r"no such file 'w\.npz' \(relative to /"):
        systems.check_config_paths(configs)


def test_serve_argv_check_refuses_a_missing_path(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(systems, "_validated", False)
    config = json.dumps({"ark": {"fabric_file": str(tmp_path / "fabric.json")}})
    with pytest.raises(SystemExit) as exit_info:
        systems.validate_serve_argv(["vllm", "serve", "m", "--additional-config", config],
                                    environ={})  # fmt: skip
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "ark" in err and "fabric_file: no such file" in err


def test_top_level_help_shows_no_rest_markup():
    result = subprocess.run([sys.executable, "-m", "vllm_ext.cli", "--help"], capture_output=True,
                            text=True, timeout=60)  # fmt: skip
    assert result.returncode == 0
    assert "vllm-ext serve MODEL --plugins leap,histate" in result.stdout
    assert "`" not in result.stdout, result.stdout


def test_serve_help_shows_ours_then_vllm_serves_own():
    pytest.importorskip("vllm")
    result = subprocess.run([sys.executable, "-m", "vllm_ext.cli", "serve", "--help"],
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    ours = result.stdout.index("--plugins")
    assert ours < result.stdout.index("--dry-run")
    # vLLM's own serve help comes after ours (its usage line, then its config groups)
    theirs = result.stdout.index("usage: vllm serve")
    assert ours < theirs and "ModelConfig" in result.stdout[theirs:], result.stdout[-3000:]
