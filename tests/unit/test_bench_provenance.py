"""What a result records about its making: no host name or absolute path, the command line,
each variant's resolved config."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from vllm_ext.bench import BenchResult, collect_fingerprint, make_headline, write_result
from vllm_ext.bench.fingerprint import fingerprint_summary, git_state
from vllm_ext.bench.provenance import (
    command_line,
    current_command,
    resolve_additional_config,
    resolve_system_config,
    scrub,
    serve_config,
)
from vllm_ext.common.config import env_var_name
from vllm_ext.common.systems import config_class
from vllm_ext.flide.config import FlideConfig
from vllm_ext.histate.config import HiStateConfig
from vllm_ext.leap.config import LeapConfig

pytestmark = pytest.mark.unit


def _strings(obj):
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield k
            yield from _strings(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _strings(v)


def _private_values() -> list[str]:
    """Paths and names of this machine that a published fingerprint must not contain."""
    values = [os.getcwd(), sys.executable, sys.prefix, str(Path.home()), tempfile.gettempdir()]
    return [v for v in values if v not in ("/", "")]


@pytest.fixture(scope="module")
def fingerprint() -> dict:
    return collect_fingerprint()


def test_fingerprint_holds_no_host_name_and_no_absolute_path(fingerprint, monkeypatch) -> None:
    host = socket.gethostname()
    assert "hostname" not in fingerprint and "repo" not in fingerprint["git"]
    assert "executable" not in fingerprint["python"] and "path" not in fingerprint["vllm"]
    for text in _strings(fingerprint):
        assert not text.startswith("/"), text
        assert not any(v in text for v in _private_values()), text
        assert host not in text.replace("<host>", "").split(), text
    assert "host" not in fingerprint_summary(fingerprint)


def test_fingerprint_scrubs_paths_a_probe_reports(monkeypatch) -> None:
    # env vars are recorded; a path in one must come out without this machine's folders
    monkeypatch.setenv("VLLM_TEST_CACHE", os.path.join(os.getcwd(), "cache", "x.bin"))
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4")
    env = collect_fingerprint(include_torch=False)["env"]
    assert env["VLLM_TEST_CACHE"] == "./cache/x.bin"
    assert env["LD_PRELOAD"] == "<path>/libtcmalloc.so.4"


def test_scrub_rules() -> None:
    home, cwd, tmp = str(Path.home()), os.getcwd(), tempfile.gettempdir()
    host = socket.gethostname()
    text = f"open {cwd}/a/b.json; {tmp}/w.npz, cfg={home}/.cache/m, /opt/x/y.so http://h:1/v1"
    out = scrub({"k": [text, 3, None], "h": f"on {host}."})
    assert out["k"][0] == (
        "open ./a/b.json; <tmp>/w.npz, cfg=~/.cache/m, <path>/y.so http://h:1/v1"
    )
    assert out["k"][1:] == [3, None]
    assert out["h"] == "on <host>."
    assert scrub("a/b relative stays") == "a/b relative stays"


def test_git_state_records_the_diff_hash_of_a_dirty_checkout(tmp_path) -> None:
    repo = _git_repo(tmp_path)
    clean = git_state(repo)
    assert clean["dirty"] is False and "diff_sha256" not in clean
    assert len(clean["commit"]) == 40 and clean["branch"] == "main"
    (repo / "code.py").write_text("x = 2\n")
    dirty = git_state(repo)
    diff = subprocess.run(
        ["git", "-C", str(repo), "diff", "HEAD", "--binary"], capture_output=True, check=True
    ).stdout
    assert dirty["dirty"] is True
    assert dirty["diff_sha256"] == hashlib.sha256(diff).hexdigest()
    # a promoted result changing under benchmarks/results/ is not a code change
    (repo / "code.py").write_text("x = 1\n")
    (repo / "benchmarks" / "results" / "r.json").write_text("{}\n")
    assert git_state(repo)["dirty"] is False


def _git_repo(path: Path) -> Path:
    def git(*args):
        subprocess.run(["git", "-C", str(path), *args], check=True, capture_output=True)

    git("init", "-q", "-b", "main")
    git("config", "user.email", "t@example.com")
    git("config", "user.name", "t")
    (path / "code.py").write_text("x = 1\n")
    (path / "benchmarks" / "results").mkdir(parents=True)
    (path / "benchmarks" / "results" / "r.json").write_text("[]\n")
    git("add", ".")
    git("commit", "-q", "-m", "init")
    return path


def test_config_class_is_found_by_system_name() -> None:
    assert config_class("leap") is LeapConfig
    assert config_class("histate") is HiStateConfig
    assert config_class("flide") is FlideConfig
    with pytest.raises(KeyError):
        config_class("nosuchsystem")


def _float_field(cls) -> tuple[str, float]:
    """A top-level float setting of ``cls`` and a valid value other than its default."""
    for f in dataclasses.fields(cls):
        if isinstance(f.default, float) and not isinstance(f.default, bool) and f.default > 0:
            return f.name, f.default / 2
    raise AssertionError(f"{cls.__name__} has no positive float setting")


def test_resolved_config_has_every_field_not_only_the_keys_given() -> None:
    for cls, system in ((LeapConfig, "leap"), (HiStateConfig, "histate"), (FlideConfig, "flide")):
        assert resolve_system_config(system, {}) == scrub(dataclasses.asdict(cls()))
    key, value = _float_field(LeapConfig)
    resolved = resolve_system_config("leap", {key: value})
    assert resolved == scrub(dataclasses.asdict(dataclasses.replace(LeapConfig(), **{key: value})))
    env = {env_var_name("leap", key): str(value)}
    assert resolve_system_config("leap", {}, env)[key] == value  # the server's env counts


def test_resolved_config_paths_are_scrubbed(tmp_path) -> None:
    path_field = next(f.name for f in dataclasses.fields(LeapConfig) if f.name.endswith("_path"))
    resolved = resolve_system_config("leap", {path_field: str(tmp_path / "w.npz")})
    assert resolved[path_field] == "<tmp>/" + str(
        (tmp_path / "w.npz").relative_to(tempfile.gettempdir())
    )


def test_serve_config_resolves_every_system_of_additional_config() -> None:
    leap_key, leap_value = _float_field(LeapConfig)
    block = {"leap": {leap_key: leap_value}, "histate": {}, "other": {"a": 1}}
    args = ["--enforce-eager", "--additional-config", json.dumps(block)]
    cfg = serve_config("vllm-ext", args, {"X": "1"}, environ={}, hints="oracle")
    assert cfg["launcher"] == "vllm-ext" and cfg["serve_args"] == args and cfg["env"] == {"X": "1"}
    assert cfg["systems"]["leap"][leap_key] == leap_value
    assert cfg["systems"]["histate"] == scrub(dataclasses.asdict(HiStateConfig()))
    assert cfg["systems"]["other"] == {"a": 1}  # not a vllm_ext system: kept as given
    assert cfg["hints"] == "oracle"
    assert serve_config("vllm", ["--enforce-eager"], environ={})["systems"] == {}
    assert resolve_additional_config(None) == {}


def test_command_line_is_replayable_and_path_free() -> None:
    cmd = command_line("benchmarks.leap", ["--rates", "0.12,inf", "--out", f"{os.getcwd()}/o d"])
    assert cmd == "python -m benchmarks.leap --rates 0.12,inf --out './o d'"
    assert current_command().startswith("python ")
    assert sys.executable not in current_command()


def test_result_records_command_and_variant_configs(tmp_path) -> None:
    result = BenchResult(
        name="rec",
        description="d",
        variants={"a": {"x": 1.0}, "b": {"x": 2.0}},
        headline=make_headline("x", 1.0, 2.0, "b", False),
        fingerprint={},
        command=command_line("benchmarks.x", ["--quick"]),
        variant_configs={"a": serve_config("vllm", ["--enforce-eager"], environ={})},
    )
    raw = json.loads(write_result(result, tmp_path, plot=False)["json"].read_text())
    assert raw["command"] == "python -m benchmarks.x --quick"
    assert raw["variant_configs"]["a"]["launcher"] == "vllm"
    assert "_Command:_ `python -m benchmarks.x --quick`" in (tmp_path / "rec.md").read_text()
    old = {k: v for k, v in raw.items() if k not in ("command", "variant_configs", "schema")}
    loaded = BenchResult.from_dict(old)  # a result written before these keys existed
    assert loaded.command is None and loaded.variant_configs == {} and loaded.schema == 1
