"""``make mutants``' table stays runnable: every decision it disables exists where it says,
every test it names exists, and a twin really replaces the decision (and only while swapped)."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from tests.mutants.table import MUTANTS, by_name

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_each_patch_target_and_test_exists(mutant):
    assert mutant.patches and mutant.tests
    for module_name, qualname, _ in mutant.patches:
        owner = importlib.import_module(module_name)
        for name in qualname.split("."):
            owner = getattr(owner, name)
        assert callable(owner), (module_name, qualname)
    for test in mutant.tests:
        assert (REPO / test.split("::")[0]).is_file(), test


def test_names_are_unique_and_unknown_names_are_refused():
    assert len({m.name for m in MUTANTS}) == len(MUTANTS)
    with pytest.raises(KeyError, match="known: leap-fcfs"):
        by_name("nope")


def test_the_plugin_swaps_the_twin_in_before_a_module_imports_the_decision_by_name():
    code = (
        "from vllm_ext.etaps.pruner import migrate_slots\n"
        "from vllm_ext.etaps import slots\n"
        "print(getattr(migrate_slots, '_mutant_twin', False), "
        "getattr(slots.migrate_slots, '_mutant_twin', False))\n"
    )
    env = {"PYTHONPATH": str(REPO), "PATH": ""}
    run = [sys.executable, "-c", "import tests.mutants.plugin\n" + code]
    swapped = subprocess.run(run, capture_output=True, text=True, check=True, cwd=REPO,
                             env={**env, "MUTANT_VLLM_EXT": "etaps-migrate"})  # fmt: skip
    plain = subprocess.run(run, capture_output=True, text=True, check=True, cwd=REPO, env=env)
    assert swapped.stdout.split() == ["True", "True"], swapped.stderr
    assert plain.stdout.split() == ["False", "False"], plain.stderr
