"""The SSD tier as served: '~' expanded, capacity capped by the disk, both logged."""

from __future__ import annotations

import logging
import os
import shutil
from collections import namedtuple

import pytest

from vllm_ext.histate import ssd_tier
from vllm_ext.histate.config import HiStateConfig

MIB = 1 << 20
Usage = namedtuple("Usage", "total used free")


@pytest.fixture
def disk(monkeypatch):
    """A disk with 5 MiB free wherever asked."""
    monkeypatch.setattr(ssd_tier.shutil, "disk_usage", lambda path: Usage(0, 0, 5 * MIB))


def test_capacity_is_the_disks_free_space_plus_the_folders_own_files(disk, tmp_path, caplog):
    folder = tmp_path / "ssd"
    (folder / "ns").mkdir(parents=True)
    (folder / "ns" / "snap").write_bytes(b"x" * MIB)
    # on the logger itself: vLLM's "vllm" logger stops propagation once vLLM configured it
    log = logging.getLogger("vllm.vllm_ext.histate.ssd_tier")
    log.addHandler(caplog.handler)
    caplog.set_level(logging.INFO, logger=log.name)
    try:
        sized = ssd_tier.sized_ssd_tier(HiStateConfig(directory=str(folder)))
    finally:
        log.removeHandler(caplog.handler)
    assert sized.ssd_bytes == 6 * MIB and sized.directory == str(folder)
    assert f"SSD tier in {folder}, capacity 6 MiB (ssd_bytes 262144 MiB" in caplog.text


def test_a_smaller_setting_is_kept_and_no_ssd_tier_means_no_change(disk, tmp_path):
    config = HiStateConfig(directory=str(tmp_path / "not-yet"), ssd_bytes=MIB)
    assert ssd_tier.sized_ssd_tier(config).ssd_bytes == MIB
    assert ssd_tier.sized_ssd_tier(HiStateConfig(ssd_bytes=0)) == HiStateConfig(ssd_bytes=0)


def test_without_a_folder_the_tier_is_in_the_user_cache_folder(disk, tmp_path):
    xdg = {"XDG_CACHE_HOME": str(tmp_path / "xdg")}
    sized = ssd_tier.sized_ssd_tier(HiStateConfig(), environ=xdg)
    assert sized.directory == str(tmp_path / "xdg" / "vllm_ext" / "histate")
    assert sized.ssd_bytes == 5 * MIB
    # a relative XDG_CACHE_HOME is ignored, as the XDG spec asks
    home = os.path.expanduser("~")
    assert ssd_tier.default_directory({"XDG_CACHE_HOME": "rel"}) == \
        f"{home}/.cache/vllm_ext/histate"  # fmt: skip


def test_home_is_expanded(disk, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    sized = ssd_tier.sized_ssd_tier(HiStateConfig(directory="~/cache/histate"))
    assert sized.directory == str(tmp_path / "cache" / "histate")


def test_free_space_is_read_at_the_nearest_existing_folder(tmp_path):
    assert ssd_tier.free_bytes(str(tmp_path / "a" / "b")) == shutil.disk_usage(tmp_path).free


def test_the_config_expands_home_so_every_reader_sees_the_users_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert HiStateConfig(directory="~/.cache/histate").directory == f"{tmp_path}/.cache/histate"
