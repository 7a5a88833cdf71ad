"""Every README command block marked runnable runs as written.

Markers, on the line before a ```bash block:

- ``<!-- runnable -->``: the block must exit 0.
- ``<!-- runnable: serve NAME -->``: a ``vllm-ext serve`` command. It is started (with
  ``--host 127.0.0.1 --port P`` appended, so runs never share a port), must answer
  ``/health`` and one OpenAI completion, then runs its client blocks, then is stopped.
- ``<!-- runnable: client NAME -->``: run against server NAME's port (``localhost:8000``
  becomes ``127.0.0.1:P``); must exit 0 and print what :data:`EXPECT` says.

Each block runs in its own empty folder with ``bash -euo pipefail``; nothing is shared
between blocks but the built assets.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.e2e.conftest import server_env
from vllm_ext.serving import free_port

REPO = Path(__file__).resolve().parents[2]
MARKED = re.compile(
    r"^<!-- runnable(?:: (?P<role>serve|client) (?P<name>[a-z0-9_-]+))? -->\n"
    r"```bash\n(?P<code>.*?)^```",
    re.MULTILINE | re.DOTALL,
)
# what each client block's output must contain (the README shows these answers)
EXPECT = {
    "leap": r'"predicted_tokens":\s*[0-9.]+',
    "histate": r"^vllm_ext:histate_hit_tokens_total\{[^}]*\} [1-9]",
    "flide": r'"label":\s*" positive".*"label":\s*" negative"',
}
START_TIMEOUT_S = 600


def _blocks() -> list[tuple[str | None, str | None, str]]:
    text = (REPO / "README.md").read_text()
    return [(m["role"], m["name"], m["code"]) for m in MARKED.finditer(text)]


def _env() -> dict[str, str]:
    env = {**os.environ, **server_env()}
    # the venv's python and vllm-ext, whichever shell runs the block
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def _run(code: str, cwd: Path, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-euo", "pipefail", "-c", code], cwd=cwd, env=_env(),
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip


def test_the_readme_marks_its_quickstarts_runnable():
    blocks = _blocks()
    served = {name for role, name, _ in blocks if role == "serve"}
    clients = {name for role, name, _ in blocks if role == "client"}
    assert served == clients == set(EXPECT), (served, clients)
    assert any(role is None for role, _, _ in blocks)


@pytest.mark.parametrize("code", [c for r, _, c in _blocks() if r is None], ids=lambda c: c[:40])
def test_standalone_block_runs(code, tmp_path):
    done = _run(code, tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]


def _wait_healthy(proc: subprocess.Popen, port: int, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return
        except OSError:
            time.sleep(1)
    pytest.fail(f"server not healthy after {START_TIMEOUT_S} s:\n{log.read_text()[-4000:]}")


def _stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=30)
    except ProcessLookupError:
        return
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _client_runs(code: str, port: int, expect: str, cwd: Path) -> None:
    code = code.replace("localhost:8000", f"127.0.0.1:{port}")
    # counters reach /metrics with the engine's next stats push: allow a few tries
    for _ in range(5):
        done = _run(code, cwd, timeout=600)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
        if re.search(expect, done.stdout, re.MULTILINE | re.DOTALL):
            return
        time.sleep(2)
    pytest.fail(f"client output never matched {expect!r}:\n{done.stdout[-3000:]}")


@pytest.mark.parametrize("name", sorted(EXPECT))
def test_serve_block_serves_and_its_client_block_gets_the_answer(name, tmp_path):
    from openai import OpenAI

    blocks = _blocks()
    (serve,) = [code for role, n, code in blocks if role == "serve" and n == name]
    clients = [code for role, n, code in blocks if role == "client" and n == name]
    assert "vllm-ext serve" in serve
    model = re.search(r"--served-model-name (\S+)", serve).group(1)
    port = free_port()
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            ["bash", "-euo", "pipefail", "-c", f"{serve.rstrip()} --host 127.0.0.1 --port {port}"],
            cwd=tmp_path, env=_env(), stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    try:
        _wait_healthy(proc, port, log)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="EMPTY")
        reply = client.completions.create(model=model, prompt="Hello", max_tokens=4)
        assert reply.usage.completion_tokens > 0
        for code in clients:
            _client_runs(code, port, EXPECT[name], tmp_path)
    finally:
        _stop(proc)
