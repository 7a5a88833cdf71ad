"""The GPU probe benchmark's CPU-side logic: its runner slice, staggered refinements, headline."""

from __future__ import annotations

import torch

from benchmarks.leap.gpu_probe import REFINE_EVERY, _runner, headline
from vllm_ext.leap.probe import ProbeState


def _probe(runner, rows: int, hidden: int = 4) -> ProbeState:
    probe = ProbeState(0, "last", hidden, rows, refine_every=REFINE_EVERY)
    probe.buffer = torch.arange(rows * hidden, dtype=torch.float32).reshape(rows, hidden)
    probe.rows_written, probe.runner = rows, runner
    return probe


def test_a_packed_prefill_step_gives_each_prompts_last_row():
    prompts, decode = _probe(_runner(3, [5] * 3, [0] * 3, [5] * 3), 15).collect()
    assert decode == {}
    assert {k: v[0] for k, v in prompts.items()} == {"r0": 16.0, "r1": 36.0, "r2": 56.0}


def test_staggered_decode_makes_one_request_in_refine_every_due():
    batch = 2 * REFINE_EVERY
    computed = [100 + REFINE_EVERY - 1 + i % REFINE_EVERY for i in range(batch)]
    prompts, decode = _probe(_runner(batch, [1] * batch, computed, [100] * batch), batch).collect()
    assert prompts == {}
    assert {k: g for k, (g, _) in decode.items()} == {"r0": 32, f"r{REFINE_EVERY}": 32}


def test_headline_is_the_worst_graph_share_or_eager_without_graphs():
    graph = {"a": {"leap_share_graph_pct": 2.0, "leap_share_eager_pct": 0.5},
             "b": {"leap_share_graph_pct": 5.0, "leap_share_eager_pct": 0.1}}  # fmt: skip
    assert (headline(graph)["metric"], headline(graph)["ours"]) == ("leap_share_graph_pct", 5.0)
    eager = {"a": {"leap_share_eager_pct": 0.5}, "b": {"leap_share_eager_pct": 0.7}}
    assert (headline(eager)["metric"], headline(eager)["ours"]) == ("leap_share_eager_pct", 0.7)
