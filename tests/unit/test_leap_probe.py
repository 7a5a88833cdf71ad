"""ProbeState's delivery: the same vectors a step late when deferred, copied at their step."""

from __future__ import annotations

import pytest
import torch

from benchmarks.leap.gpu_probe import _runner
from vllm_ext.leap.probe import ProbeState

pytestmark = pytest.mark.unit

HIDDEN = 4


def _steps():
    """Three steps of (runner, buffer): two prompts end, then one, then only decodes."""
    packed = _runner(2, [3, 3], [0, 0], [3, 3])  # r0, r1 end their prompts
    single = _runner(1, [2], [0], [2])  # r0 ends its prompt
    decode = _runner(2, [1, 1], [5, 5], [3, 3])  # nothing ends
    return [(packed, 6), (single, 2), (decode, 2)]


def _collect_all(deferred: bool) -> list[tuple[dict, dict]]:
    probe = ProbeState(0, "last", HIDDEN, 8, deferred=deferred)
    probe.buffer = torch.zeros(8, HIDDEN)
    out = []
    for step, (runner, rows) in enumerate(_steps()):
        # the forward of this step overwrites the buffer (as the hook does)
        probe.buffer[:rows] = torch.arange(rows * HIDDEN, dtype=torch.float32).reshape(rows, -1)
        probe.buffer[:rows] += 100 * step
        probe.rows_written, probe.runner = rows, runner
        out.append(probe.collect())
    return out


def _last_rows(out):
    return [{req: v.tolist() for req, v in prompts.items()} for prompts, _ in out]


def test_deferred_delivery_gives_each_steps_vectors_one_call_later():
    same_step = _last_rows(_collect_all(deferred=False))
    next_step = _last_rows(_collect_all(deferred=True))
    assert same_step[0] == {"r0": [8.0, 9.0, 10.0, 11.0], "r1": [20.0, 21.0, 22.0, 23.0]}
    assert same_step[1] == {"r0": [104.0, 105.0, 106.0, 107.0]}
    assert same_step[2] == {}
    # values of their own step, though the buffer was overwritten before delivery
    assert next_step == [{}, same_step[0], same_step[1]]
