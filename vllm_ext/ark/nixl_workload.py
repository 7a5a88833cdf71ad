"""NIXL pulls over the namespace leaf-spine with ARK-planned or random ports (root, ``nixl``).

Each pair is a prefill-side NIXL agent on a leaf-0 host (UCX listener port
``LISTENER``) and a decode-side agent on a leaf-1 host that READs the buffer
(:mod:`.nixl_pull`), the decode process preloaded with ARK's shim. The KV flows
``prefill:LISTENER -> decode:port``; ``port`` comes from ``ARK_SPORT_MAP``:

* ``ark``: :class:`~vllm_ext.ark.connplan.ConnectionPlan` over a path map learned
  by asking the prefill leaf's FIB for each candidate (``ip route get``), one
  plan for all pairs -- the complete view announcements would give (the serving
  connector, ``ArkNixlConnector``, plans only its own connections);
* ``random``: a seeded random candidate port per pair (plain ECMP).

All pairs start together; per-spine byte counters are read around each run.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from vllm_ext.ark.connplan import ConnectionPlan
from vllm_ext.ark.fabric import Fabric
from vllm_ext.ark.netns import LeafSpine, host_ip
from vllm_ext.ark.paths import LearnedMap

LISTENER = 46000
CANDIDATES = tuple(range(31000, 31016))
VARIANTS = ("random", "ark")


def learn_paths(fabric: LeafSpine, pairs: Sequence[tuple[tuple[int, int], tuple[int, int]]]):
    """The probed map of the pull direction (prefill listener -> decode candidate port)."""
    paths = LearnedMap()
    for src, dst in pairs:
        for port in CANDIDATES:
            spine = fabric.route_spine(host_ip(*src), host_ip(*dst), LISTENER, port)
            if spine is not None:
                paths.record(host_ip(*src), host_ip(*dst), LISTENER, port, spine)
    return paths


def choose_ports(fabric: LeafSpine, pairs, variant: str, seed: int,
                 paths: LearnedMap) -> list[int]:  # fmt: skip
    """One decode port per pair (its one connection)."""
    if variant == "random":
        rng = random.Random(seed)
        return [rng.choice(CANDIDATES) for _ in pairs]
    if variant != "ark":
        raise ValueError(f"unknown variant {variant!r}; choose from {VARIANTS}")
    model = Fabric(fabric.leaf_of_ip(), fabric.n_spines)
    placed: list = []  # one list for all decode hosts: each plan sees every connection
    plans = {}
    out = []
    for src, dst in pairs:
        if dst not in plans:
            plans[dst] = ConnectionPlan(host_ip(*dst), model, paths, CANDIDATES, placed)
        out.append(plans[dst].ports(host_ip(*src), LISTENER, 1)[0])
    return out


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("UCX_", "LD_PRELOAD"))}
    return {**env, "UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0", **extra}


def _wait_for(files: Sequence[Path], procs, deadline: float, what: str) -> None:
    """Until every file exists; a clear error when an agent died or the time is up."""
    while not all(f.exists() for f in files):
        dead = [p for p in procs if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            tails = "; ".join(p.stderr.read().decode()[-500:] for p in dead)
            raise RuntimeError(f"NIXL {what} agents did not get ready: {tails or 'timeout'}")
        time.sleep(0.02)


def run_pulls(fabric: LeafSpine, pairs, ports: Sequence[int], nbytes: int, shim: str,
              seed: int = 0, timeout_s: float = 300.0) -> dict:  # fmt: skip
    """All pairs pull ``nbytes`` at once; FCTs, per-spine bytes to leaf 1, shim counts."""
    mod = [sys.executable, "-m", "vllm_ext.ark.nixl_pull"]
    with tempfile.TemporaryDirectory(prefix="ark-nixl-") as tmp:
        stop = Path(tmp) / "stop"
        servers, pulls = [], []
        for i, (src, _) in enumerate(pairs):
            meta = Path(tmp) / f"meta{i}.json"
            servers.append(subprocess.Popen(
                ["ip", "netns", "exec", fabric.host(*src), *mod, "serve", "--name", f"p{i}",
                 "--meta", str(meta), "--stop", str(stop), "--bytes", str(nbytes),
                 "--seed", str(seed + i), "--timeout", str(timeout_s)],
                env=_env({"UCX_TCP_PORT_RANGE": f"{LISTENER}-{LISTENER}"}),
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))  # fmt: skip
        try:
            deadline = time.monotonic() + timeout_s
            metas = [Path(tmp) / f"meta{i}.json" for i in range(len(pairs))]
            _wait_for(metas, servers, deadline, "serve")
            go = Path(tmp) / "go"
            pulls = [subprocess.Popen(
                ["ip", "netns", "exec", fabric.host(*dst), *mod, "pull", "--name", f"d{i}",
                 "--meta", str(Path(tmp) / f"meta{i}.json"), "--bytes", str(nbytes),
                 "--go", str(go),
                 "--seed", str(seed + i), "--timeout", str(timeout_s)],
                env=_env({"LD_PRELOAD": shim,
                          "ARK_SPORT_MAP": f"{host_ip(*src)}:{LISTENER}={port}"}),
                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                for i, ((src, dst), port) in enumerate(zip(pairs, ports, strict=True))]  # fmt: skip
            _wait_for([m.with_suffix(".json.ready") for m in metas], pulls, deadline, "pull")
            before = fabric.spine_tx_bytes()
            go.touch()
            results = []
            for proc in pulls:
                out, err = proc.communicate(timeout=timeout_s)
                lines = out.decode().strip().splitlines()
                if not lines:
                    raise RuntimeError(f"NIXL pull failed: {err.decode()[-800:]}")
                results.append(json.loads(lines[-1]))
            after = fabric.spine_tx_bytes()
        finally:
            stop.touch()
            for proc in pulls + servers:
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
    to_decode = [after[s].get(1, 0) - before[s].get(1, 0) for s in range(fabric.n_spines)]
    return {"fcts_s": [r["seconds"] for r in results], "ok": [r["ok"] for r in results],
            "shim_applied": [r["shim_applied"] for r in results], "ports": list(ports),
            "spine_bytes_to_decode": to_decode}  # fmt: skip
