"""Asset folders: built once, checked by manifest, rebuilt when invalid, never half-written."""

from __future__ import annotations

import pytest

from vllm_ext.assets import store


@pytest.fixture(autouse=True)
def tmp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(store.CACHE_ENV, str(tmp_path))
    return tmp_path


def _builder(calls, payload=b"weights"):
    def build(folder):
        calls.append(folder)
        (folder / "model.bin").write_bytes(payload)
        (folder / "sub").mkdir()
        (folder / "sub" / "cfg.json").write_text("{}")

    return build


def test_built_once_then_reused():
    calls = []
    first = store.ensure("m", "r1", _builder(calls))
    second = store.ensure("m", "r1", _builder(calls))
    assert first == second and len(calls) == 1
    assert (first / "model.bin").read_bytes() == b"weights"
    assert store.check(first, "r1", full=True) is None


def test_recipe_change_rebuilds():
    calls = []
    store.ensure("m", "r1", _builder(calls))
    store.ensure("m", "r2", _builder(calls, b"new"))
    assert len(calls) == 2
    assert (store.cache_dir() / "m" / "model.bin").read_bytes() == b"new"


def test_corruption_detected_by_size_and_by_hash():
    calls = []
    path = store.ensure("m", "r1", _builder(calls))
    (path / "model.bin").write_bytes(b"weightX")  # same size, different bytes
    assert store.check(path, "r1", full=False) is None
    assert "checksum" in store.check(path, "r1", full=True)
    store.ensure("m", "r1", _builder(calls), verify=True)
    assert len(calls) == 2 and (path / "model.bin").read_bytes() == b"weights"
    (path / "model.bin").write_bytes(b"short")
    assert "wrong size" in store.check(path, "r1", full=False)


def test_failed_build_leaves_nothing_that_looks_complete():
    def broken(folder):
        (folder / "model.bin").write_bytes(b"partial")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        store.ensure("m", "r1", broken)
    assert not (store.cache_dir() / "m").exists()
    assert list(store.cache_dir().iterdir()) == []


def test_cache_folder_comes_from_the_new_variable_and_the_old_one_is_an_error(
    tmp_cache, monkeypatch
):
    assert store.CACHE_ENV == "VLLMEXT_ASSETS_DIR" and store.cache_dir() == tmp_cache
    monkeypatch.setenv("VLLM_EXT_ASSETS_DIR", str(tmp_cache))
    with pytest.raises(ValueError, match="VLLM_EXT_ASSETS_DIR -> VLLMEXT_ASSETS_DIR"):
        store.cache_dir()
