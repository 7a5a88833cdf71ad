"""HiState's SSD folder: private modes, and a folder others could write is refused at start.

The attack: a local user who can write the SSD folder plants a well-formed snapshot (valid
header and checksums, our namespace) under a key a future prompt hits; the checksums catch
damage, not forgery. Each test plants such a file under a hot key (one a genuine store
wrote and serves) and shows the scheduler's scan and the worker's store refuse the folder
before reading it, so the forged state is never served. The override test shows what the
refusal protects: with it waived, the forged state is served.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import subprocess
import sys

import numpy as np
import pytest

from vllm_ext.common.config import ConfigError
from vllm_ext.histate import snapfile
from vllm_ext.histate.config import HiStateConfig
from vllm_ext.histate.folder_safety import PRIVATE, FolderPolicy, folder_refusal
from vllm_ext.histate.snapfile import SnapshotStore, pack_arrays, scan

pytestmark = pytest.mark.unit

NS = "model=tiny;dtype=bf16;layers=GGGA;block=64;tp=0/1"
HOT = "prefix-hash-1234:snap"
GENUINE = pack_arrays({"state": np.ones((2, 4), np.float32)})
FORGED = pack_arrays({"state": np.full((2, 4), 7.0, np.float32)})
NOBODY = 65534


@pytest.fixture(autouse=True)
def _umask():
    old = os.umask(0o022)
    yield
    os.umask(old)


@pytest.fixture
def planted(tmp_path):
    """SSD folder whose hot key's file was replaced by a well-formed forgery."""
    ssd = tmp_path / "ssd"
    store = SnapshotStore(ssd, NS)
    assert store.put(HOT, GENUINE)
    path = store.path(HOT)
    store.close()
    path.write_bytes(snapfile.encode(NS, HOT, FORGED))
    # the forgery passes every check a snapshot file gets
    assert SnapshotStore(ssd, NS).get(HOT) == FORGED
    return ssd, path


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def _refused(ssd, access=PRIVATE, match="unsafe"):
    with pytest.raises(ConfigError, match=match) as err:
        scan(ssd, NS, access=access)
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=match):
        SnapshotStore(ssd, NS, access=access)


def test_a_new_store_is_private(tmp_path):
    store = SnapshotStore(tmp_path / "a" / "ssd", NS)
    assert store.put(HOT, GENUINE)
    folders = [tmp_path / "a" / "ssd", store.root, store.root.parent / snapfile.WRITERS]
    assert [_mode(f) for f in folders] == [0o700] * 3
    locks = list((store.root.parent / snapfile.WRITERS).iterdir())
    assert [_mode(f) for f in [store.path(HOT), *locks]] == [0o600] * 2


def test_a_group_shared_store_is_group_readable_not_writable(tmp_path):
    store = SnapshotStore(tmp_path / "ssd", NS, access=FolderPolicy(shared_group=True))
    assert store.put(HOT, GENUINE)
    assert (_mode(tmp_path / "ssd"), _mode(store.root), _mode(store.path(HOT))) == (
        0o750, 0o750, 0o640
    )  # fmt: skip


def test_an_old_world_readable_tree_is_narrowed(tmp_path):
    store = SnapshotStore(tmp_path / "ssd", NS)
    store.put(HOT, GENUINE)
    store.close()
    for path, mode in ((tmp_path / "ssd", 0o755), (store.root, 0o755), (store.path(HOT), 0o644)):
        os.chmod(path, mode)
    again = SnapshotStore(tmp_path / "ssd", NS)
    assert (_mode(tmp_path / "ssd"), _mode(store.root), _mode(store.path(HOT))) == (
        0o700, 0o700, 0o600
    )  # fmt: skip
    assert again.get(HOT) == GENUINE


@pytest.mark.parametrize("where", ["root", "namespace folder"])
def test_world_writable_folder_with_a_planted_snapshot_is_refused(planted, where):
    ssd, path = planted
    os.chmod(ssd if where == "root" else path.parent, 0o777)
    _refused(ssd, match="writable by every user")
    _refused(ssd, FolderPolicy(shared_group=True), match="writable by every user")


def test_group_writable_folder_is_refused_unless_group_shared(planted):
    ssd, _ = planted
    os.chmod(ssd, 0o770)
    _refused(ssd, match="writable by its group")
    # a group-shared cache trusts its group (we are in the folder's group: it is ours)
    assert SnapshotStore(ssd, NS, access=FolderPolicy(shared_group=True)).get(HOT) == FORGED


@pytest.mark.parametrize(
    "what", ["root", "namespace folder", "snapshot file", "fingerprint cache"]
)
def test_foreign_owned_folder_or_file_is_refused(planted, what):
    ssd, path = planted
    (ssd / "weights-fingerprints.json").write_text("{}")
    target = {"root": ssd, "namespace folder": path.parent, "snapshot file": path,
              "fingerprint cache": ssd / "weights-fingerprints.json"}[what]  # fmt: skip
    os.chown(target, NOBODY, NOBODY)
    _refused(ssd, match=f"owned by uid {NOBODY}")
    # another user outside our groups is not a group member either
    _refused(ssd, FolderPolicy(shared_group=True), match=f"owned by uid {NOBODY}")


def test_a_link_planted_for_a_subfolder_is_refused(tmp_path):
    ssd = tmp_path / "ssd"
    ssd.mkdir(mode=0o700)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (ssd / snapfile.QUARANTINE).symlink_to(elsewhere)
    _refused(ssd, match="is a link")


def test_a_parent_others_may_write_is_refused_unless_sticky(tmp_path):
    parent = tmp_path / "shared"
    parent.mkdir()
    SnapshotStore(parent / "ssd", NS).close()
    os.chmod(parent, 0o777)
    _refused(parent / "ssd", match="parent .* writable by others")
    os.chmod(parent, 0o1777)  # like /tmp: others cannot rename or remove our folder
    SnapshotStore(parent / "ssd", NS).close()


def test_the_override_starts_loudly_and_shows_what_the_refusal_protects(planted, caplog):
    ssd, _ = planted
    os.chmod(ssd, 0o777)
    with caplog.at_level(logging.WARNING, logger="vllm.vllm_ext.histate.folder_safety"):
        store = SnapshotStore(ssd, NS, access=FolderPolicy(allow_unsafe=True))
    assert "UNSAFE" in caplog.text
    assert store.get(HOT) == FORGED  # waived: the planted state is served


def test_config_fields_and_the_serve_preflight(planted):
    ssd, _ = planted
    config = HiStateConfig(directory=str(ssd))
    assert FolderPolicy.of(config) == FolderPolicy() and folder_refusal(config) is None
    os.chmod(ssd, 0o777)
    assert "writable by every user" in folder_refusal(config)
    assert folder_refusal(HiStateConfig(directory=str(ssd), allow_unsafe_directory=True)) is None
    assert folder_refusal(HiStateConfig(directory=str(ssd), ssd_bytes=0)) is None
    with pytest.raises(ConfigError, match="shared_group must be a boolean"):
        HiStateConfig(shared_group="yes")


def test_vllm_ext_serve_refuses_the_folder_before_vllm_starts(planted):
    ssd, _ = planted
    os.chmod(ssd, 0o777)
    block = json.dumps({"histate": {"directory": str(ssd)}})
    run = subprocess.run(
        [sys.executable, "-m", "vllm_ext.cli", "serve", "m", "--plugins", "histate",
         "--dry-run", "--additional-config", block],
        capture_output=True, text=True,
    )  # fmt: skip
    assert run.returncode == 2, run.stdout + run.stderr
    assert run.stderr.count("\n") == 1 and "writable by every user" in run.stderr
    assert "Equivalent command" not in run.stdout
