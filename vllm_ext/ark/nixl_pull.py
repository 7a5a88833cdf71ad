"""Two NIXL agents moving a host buffer the way vLLM's NIXL pull mode moves KV (needs ``nixl``).

``serve``: a prefill-side agent registers ``--bytes`` of DRAM filled with a
seeded pattern, writes its agent metadata and the serialized descriptors to
``--meta`` and waits until ``--stop`` exists. ``pull``: a decode-side agent
adds the remote agent (UCX connects to the serve side's listener here, so a
preloaded ARK shim applies its ports now), READs the whole buffer into its own
DRAM, checks the pattern and prints one JSON line (bytes, seconds, ok); with
``--go`` it first writes ``<meta>.ready`` and waits for that file, so several
pulls start together. Run
each in its host's network namespace (:mod:`.nixl_workload`); UCX over TCP
(``UCX_TLS=tcp``), the listener port from ``UCX_TCP_PORT_RANGE``.
"""

from __future__ import annotations

import argparse
import base64
import ctypes
import json
import sys
import time
from pathlib import Path

import numpy as np


def _pattern(nbytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def _agent(name: str):
    from nixl._api import nixl_agent, nixl_agent_config

    return nixl_agent(name, nixl_agent_config(backends=["UCX"]))


def _shim_applied() -> int | None:
    """Ports the preloaded ARK shim applied in this process (None: not preloaded)."""
    lib = ctypes.CDLL(None)
    if not hasattr(lib, "ark_shim_applied"):
        return None
    lib.ark_shim_applied.restype = ctypes.c_ulong
    return int(lib.ark_shim_applied())


def serve(args: argparse.Namespace) -> int:
    agent = _agent(args.name)
    buf = _pattern(args.bytes, args.seed)
    region = [(buf.ctypes.data, buf.nbytes, 0, "")]
    agent.register_memory(region, "DRAM")
    descs = agent.get_xfer_descs([(buf.ctypes.data, buf.nbytes, 0)], "DRAM")
    meta = {"agent": base64.b64encode(agent.get_agent_metadata()).decode(),
            "descs": base64.b64encode(agent.get_serialized_descs(descs)).decode()}  # fmt: skip
    tmp = Path(args.meta).with_suffix(".tmp")
    tmp.write_text(json.dumps(meta))
    tmp.replace(args.meta)
    deadline = time.monotonic() + args.timeout
    while not Path(args.stop).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return 0


def pull(args: argparse.Namespace) -> int:
    meta = json.loads(Path(args.meta).read_text())
    agent = _agent(args.name)
    buf = np.zeros(args.bytes, dtype=np.uint8)
    agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
    local = agent.get_xfer_descs([(buf.ctypes.data, buf.nbytes, 0)], "DRAM")
    if args.go:  # start together with the other pulls: say we are ready, wait for the word
        Path(args.meta + ".ready").touch()
        deadline = time.monotonic() + args.timeout
        while not Path(args.go).exists() and time.monotonic() < deadline:
            time.sleep(0.005)
    start = time.monotonic()
    peer = agent.add_remote_agent(base64.b64decode(meta["agent"]))
    remote = agent.deserialize_descs(base64.b64decode(meta["descs"]))
    handle = agent.initialize_xfer("READ", local, remote, peer)
    state = agent.transfer(handle)
    deadline = start + args.timeout
    while state not in ("DONE", "ERR") and time.monotonic() < deadline:
        state = agent.check_xfer_state(handle)
    seconds = time.monotonic() - start
    ok = state == "DONE" and bool(np.array_equal(buf, _pattern(args.bytes, args.seed)))
    print(json.dumps({"bytes": args.bytes, "seconds": seconds, "state": state, "ok": ok,
                      "shim_applied": _shim_applied()}))  # fmt: skip
    sys.stdout.flush()
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("role", choices=("serve", "pull"))
    parser.add_argument("--name", required=True)
    parser.add_argument("--meta", required=True, help="metadata file (serve writes, pull reads)")
    parser.add_argument("--stop", default="", help="serve: exit once this file exists")
    parser.add_argument("--go", default="", help="pull: start once this file exists")
    parser.add_argument("--bytes", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args(argv)
    return serve(args) if args.role == "serve" else pull(args)


if __name__ == "__main__":
    raise SystemExit(main())
