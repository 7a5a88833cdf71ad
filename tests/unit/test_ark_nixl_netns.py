"""NIXL READs (UCX over TCP) across the namespace leaf-spine with ARK-planned ports: two
decode hosts pull from two prefill hosts at once, the shim applies the planned port to each
pull's connection, and the per-spine byte counters show the KV crossed the two spines the
probed path map predicted, one pull per spine. Needs root, ip, a C compiler and ``nixl``."""

from __future__ import annotations

import importlib.util
import os
import shutil

import pytest

from vllm_ext.ark.shim import build

pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip"), reason="needs root and ip"),
    pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler"),
    pytest.mark.skipif(
        importlib.util.find_spec("nixl") is None,
        reason="nixl not installed (pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1)",
    ),  # fmt: skip
]
MB = 1_000_000


def test_planned_nixl_pulls_take_the_predicted_distinct_spines():
    from vllm_ext.ark.netns import LeafSpine, host_ip
    from vllm_ext.ark.nixl_workload import LISTENER, choose_ports, learn_paths, run_pulls

    with LeafSpine(2, 2, 2, rate_mbit=200.0) as fabric:
        pairs = [((0, 0), (1, 0)), ((0, 1), (1, 1))]
        paths = learn_paths(fabric, pairs)
        ports = choose_ports(fabric, pairs, "ark", 0, paths)
        spines = [paths.spine(host_ip(*s), host_ip(*d), LISTENER, p)
                  for (s, d), p in zip(pairs, ports, strict=True)]  # fmt: skip
        assert sorted(spines) == [0, 1]
        got = run_pulls(fabric, pairs, ports, 2 * MB, str(build()))
    assert all(got["ok"]) and all(n and n >= 1 for n in got["shim_applied"]), got
    # each spine carried one pull's KV towards the decode leaf (plus headers and acks)
    assert all(2 * MB <= b < 3 * MB for b in got["spine_bytes_to_decode"]), got
