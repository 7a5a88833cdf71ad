"""README.md and docs/*.md show what the code and the result files say (``make docs``)."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SYSTEMS = ("leap", "histate", "flide")


@pytest.fixture(scope="module")
def gen():
    spec = importlib.util.spec_from_file_location("docs_gen", REPO / "docs" / "gen.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["docs_gen"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def test_generated_parts_equal_a_fresh_rendering(gen):
    # regenerated in memory from the config dataclasses, counter declarations and results
    assert gen.stale_files() == [], "run `make docs`"


def test_every_system_page_has_its_generated_parts(gen):
    for system in SYSTEMS:
        text = (REPO / "docs" / f"{system}.md").read_text()
        blocks = {(m["kind"], m["arg"]) for m in gen.BLOCK.finditer(text)}
        assert blocks == {("config", system), ("metrics", system), ("results", system)}, system
    readme = {(m["kind"], m["arg"]) for m in gen.BLOCK.finditer((REPO / "README.md").read_text())}
    assert readme == {("systems", None), ("extras", None)}


def test_a_changed_result_makes_the_readme_stale(gen, monkeypatch):
    real = gen.load_headline

    def doubled(system, name, what):
        head = real(system, name, what)
        return dataclasses.replace(head, ours=head.ours * 2) if name == "flide" else head

    monkeypatch.setattr(gen, "load_headline", doubled)
    assert set(gen.stale_files()) == {"README.md", "docs/flide.md"}


def test_a_figure_from_a_dirty_tree_is_marked(gen, monkeypatch):
    real = gen.load_headline
    monkeypatch.setattr(gen, "load_headline",
                        lambda *a: dataclasses.replace(real(*a), dirty=False))  # fmt: skip
    clean = gen.render_results("flide")
    monkeypatch.setattr(gen, "load_headline",
                        lambda *a: dataclasses.replace(real(*a), dirty=True))  # fmt: skip
    dirty = gen.render_results("flide")
    assert gen.DIRTY_MARK not in clean and gen.DIRTY_NOTE not in clean
    assert gen.DIRTY_MARK in dirty and gen.DIRTY_NOTE in dirty


def test_every_setting_and_counter_is_in_its_page(gen):
    from vllm_ext.histate.runtime import COUNTER_SPECS
    from vllm_ext.leap.runtime import COUNTERS

    leap = (REPO / "docs" / "leap.md").read_text()
    histate = (REPO / "docs" / "histate.md").read_text()
    from vllm_ext.common.counters import CounterSpec

    def exported(system: str, spec) -> str:
        # counters end in _total; gauges and histograms carry their unit instead
        return f"`vllm_ext:{system}_{spec.name}{'_total' if isinstance(spec, CounterSpec) else ''}`"

    for spec in COUNTERS:
        assert exported("leap", spec) in leap
    for spec in COUNTER_SPECS:
        assert exported("histate", spec) in histate
    for system in SYSTEMS:
        page = (REPO / "docs" / f"{system}.md").read_text()
        for field in dataclasses.fields(gen._config_class(system)):
            assert f"`{field.name}`" in page, (system, field.name)


def test_ratio_targets_are_read_and_judged(gen):
    head = gen.load_headline("flide", "flide", "")

    def judged(**change):
        return gen.ratio_target(dataclasses.replace(head, **change))

    assert judged(ratio=9.6, target=9.5) == ("ratio ≥ 9.5", True)
    assert judged(ratio=1.2, target="ratio < 1 (x)") == ("ratio < 1", False)
    assert judged(target="free text")[1] is None


def test_the_readme_stays_short_and_cites_only_kept_results(gen):
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    cited = {name for _, name, _ in gen.CITED}
    quoted = set(re.findall(r"benchmarks/results/([a-z0-9_]+)\.", text))
    assert quoted <= cited and all((gen.RESULTS / f"{n}.json").is_file() for n in cited)
