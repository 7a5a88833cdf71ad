"""ARK on a small namespace leaf-spine: planned ports land on distinct spines (per-spine
counters), and the namespaces are gone afterwards, also when the body fails. Needs root."""

from __future__ import annotations

import os
import shutil
import threading
import time

import pytest

from vllm_ext.ark.announce import Announcer
from vllm_ext.ark.fabric import Fabric, Transfer
from vllm_ext.ark.netns import LeafSpine, host_ip, in_netns, ip
from vllm_ext.ark.paths import LearnedMap
from vllm_ext.ark.selector import PortSelector
from vllm_ext.ark.testbed import CANDIDATES, DATA_PORT, Receiver, send_flow

pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip"), reason="needs root and ip"),
]
MB = 1_000_000


def _ours(prefix: str) -> list[str]:
    return [line for line in ip("netns", "list").splitlines() if line.startswith(prefix)]


def test_planned_flows_take_distinct_spines():
    fabric = LeafSpine(2, 4, 2, rate_mbit=200.0)
    with fabric:
        model = Fabric(fabric.leaf_of_ip(), fabric.n_spines)
        senders, receivers = [(0, 0), (0, 1)], [(1, 0), (1, 1)]
        paths = LearnedMap()
        for s, d in zip(senders, receivers, strict=True):
            assert paths.learn(fabric.route_spine, host_ip(*s), host_ip(*d), DATA_PORT,
                               CANDIDATES) == len(CANDIDATES)  # fmt: skip
        peers = {f"p{i}": (host_ip(*s), 9100) for i, s in enumerate(senders)}
        announcers = [in_netns(fabric.host(*s), lambda s=s, i=i: Announcer(
            f"p{i}", host_ip(*s), 9100, peers)) for i, s in enumerate(senders)]  # fmt: skip
        rx = [Receiver(fabric, *d) for d in receivers]
        try:
            for a in announcers:
                a.heartbeat()
            for a in announcers:
                assert a.poll(timeout=5.0) >= 1  # heard the other one over the fabric
            ports = []
            for i, (s, d) in enumerate(zip(senders, receivers, strict=True)):
                now = time.monotonic()
                t = Transfer(f"t{i}", host_ip(*s), host_ip(*d), 2 * MB, now, now + 10, 0, DATA_PORT)
                choice = PortSelector(announcers[i], model, paths).select(t, CANDIDATES)
                assert choice.reason == "planned"
                ports.append(choice)
                announcers[1 - i].poll(timeout=5.0)  # the other sender sees it before planning
            assert {c.spine for c in ports} == {0, 1}
            before = fabric.spine_tx_bytes()
            flows = [threading.Thread(target=send_flow, args=(fabric, s, host_ip(*d), c.port,
                                                              2 * MB))
                     for s, d, c in zip(senders, receivers, ports, strict=True)]  # fmt: skip
            for f in flows:
                f.start()
            for f in flows:
                f.join()
            after = fabric.spine_tx_bytes()
            carried = [a[1] - b[1] for a, b in zip(after, before, strict=True)]
            for c in ports:  # each spine carried one 2 MB flow (plus headers), not both
                assert 2 * MB <= carried[c.spine] < 2.5 * MB, carried
            assert sum(r.received for r in rx) == 4 * MB
        finally:
            for a in announcers:
                a.close()
            for r in rx:
                r.close()
    assert _ours(fabric.prefix) == []


def test_namespaces_are_removed_when_the_body_fails():
    fabric = LeafSpine(2, 1, 1, rate_mbit=100.0)
    with pytest.raises(RuntimeError, match="boom"):
        with fabric:
            assert len(_ours(fabric.prefix)) == 2 + 1 + 2
            raise RuntimeError("boom")
    assert _ours(fabric.prefix) == []
