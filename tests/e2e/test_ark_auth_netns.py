"""ARK under attack on the namespace leaf-spine: forged KV frames and spoofed announcements.

Prefill ``vllm serve`` in host (0, 0), decode in host (1, 0), the client (the test acting as
the P/D proxy) in host (0, 1), a third host, the attacker, in (1, 1). Both servers hold the
same ``secret_file``; the decode side lists the prefill host and the attacker's address in
``kv_senders`` (the attacker stands for a host that took over an allowed address: the case
only the HMAC stops), the prefill side lists the attacker's address as its one announcement
peer. The attacker first asks the prefill instance for a genuine frame of a prompt's length
(so its forgery has the exact layout a decode cache accepts), then, for a live transfer id,
sends the decode listener that frame with the KV zeroed, before and after the prefill, tagged
with a wrong key and untagged; the client host (not in ``kv_senders``) sends one too. It
also sends the prefill instance spoofed announcements from the configured peer's address.
Checked: the P/D answer equals the prefill instance's own; a request whose only frame was
forged falls back to prefill on the decode instance (same answer, one load timeout); the
drops are on /metrics (frames_unauthenticated, frames_unknown_sender,
announcements_dropped{reason="bad_mac"}), and the decode side received only genuine frames.
Needs root and ``ip netns``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import struct
import subprocess
import time
import urllib.request
import uuid

import numpy as np
import pytest

from tests.e2e.ark_pd import ark_kv_config
from tests.e2e.conftest import SERVE_ARGS, server_env, wait_for_metric
from tests.e2e.test_ark_pd_netns import NsServer
from vllm_ext.ark import auth
from vllm_ext.ark.announce import encode
from vllm_ext.ark.fabric import Transfer
from vllm_ext.ark.netns import LeafSpine, host_ip, in_netns
from vllm_ext.ark.transport import MAGIC, MAGIC_MAC
from vllm_ext.assets import model_path
from vllm_ext.serving import start_together


def _netns_works() -> bool:
    if os.geteuid() != 0 or not shutil.which("ip"):
        return False
    return subprocess.run(["ip", "netns", "list"], capture_output=True).returncode == 0


pytestmark = pytest.mark.skipif(not _netns_works(), reason="needs root and ip netns")

DATA_PORT, ANNOUNCE_PORT, CAPTURE_PORT = 7100, 7200, 7300
PREFILL, DECODE, CLIENT, ATTACKER = (0, 0), (1, 0), (0, 1), (1, 1)
LOAD_TIMEOUT_S = 10.0
WRONG_KEY = b"not-the-secret-not-the-secret!!!"
_PREFIX = struct.Struct("!4sIQ")


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    logs = tmp_path_factory.mktemp("ark-auth")
    secret = logs / "ark.secret"
    secret.write_text(os.urandom(32).hex() + "\n")
    os.chmod(secret, 0o600)
    with LeafSpine(2, 2, 2, rate_mbit=200.0) as fabric:
        src, dst, attacker = host_ip(*PREFILL), host_ip(*DECODE), host_ip(*ATTACKER)
        prefill_ark = {"host": src, "announce_port": ANNOUNCE_PORT, "port_base": 41000,
                       "port_count": 8, "peers": [f"{attacker}:{ANNOUNCE_PORT}"],
                       "secret_file": str(secret)}  # fmt: skip
        decode_ark = {"host": dst, "data_port": DATA_PORT, "kv_senders": [src, attacker],
                      "secret_file": str(secret), "load_timeout_s": LOAD_TIMEOUT_S}  # fmt: skip
        model = str(model_path("smollm2"))
        common = [*SERVE_ARGS, "--served-model-name", "smollm2", "--dtype", "float32"]
        env = {**server_env(), "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}

        def make(where, role, ark):
            args = [*common, "--kv-transfer-config", ark_kv_config(role),
                    "--additional-config", json.dumps({"ark": ark})]  # fmt: skip
            return NsServer(fabric.host(*where), host_ip(*where), model, args, env=env,
                            log_path=logs / f"{role}.log", startup_timeout_s=600)  # fmt: skip

        servers = [make(PREFILL, "kv_producer", prefill_ark),
                   make(DECODE, "kv_consumer", decode_ark)]  # fmt: skip
        try:
            errors = start_together(servers)
            if errors:
                raise errors[0]
            yield fabric, *servers
        finally:
            for server in servers:
                server.stop()


def _post(fabric, where, url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})  # fmt: skip

    def post():
        with urllib.request.urlopen(request, timeout=300) as resp:
            return json.loads(resp.read())

    return in_netns(fabric.host(*where), post)


def _body(prompt: list[int], **extra) -> dict:
    return {"model": "smollm2", "prompt": prompt, "max_tokens": 8, "temperature": 0,
            "logprobs": 1, **extra}  # fmt: skip


def _tokens(reply: dict) -> list[str]:
    return reply["choices"][0]["logprobs"]["tokens"]


def _prefill(fabric, prefill, prompt, transfer_id: str, kv_to: tuple[str, int]) -> None:
    params = {"do_remote_decode": True, "transfer_id": transfer_id, "remote_host": kv_to[0],
              "remote_port": kv_to[1]}  # fmt: skip
    _post(fabric, CLIENT, prefill.base_url + "/v1/completions",
          _body(prompt, max_tokens=1, kv_transfer_params=params))  # fmt: skip


def _decode(fabric, decode, prompt, transfer_id: str) -> list[str]:
    params = {"do_remote_prefill": True, "transfer_id": transfer_id}
    reply = _post(fabric, CLIENT, decode.base_url + "/v1/completions",
                  _body(prompt, kv_transfer_params=params))  # fmt: skip
    return _tokens(reply)


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("closed mid-frame")
        buf += chunk
    return bytes(buf)


def _capture_genuine_frame(fabric, prefill, prompt) -> tuple[dict, int]:
    """The attacker asks the prefill instance to push a prompt's KV to it: (meta, payload size)."""
    attacker = host_ip(*ATTACKER)

    def listen():
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((attacker, CAPTURE_PORT))
        sock.listen(1)
        sock.settimeout(300)
        return sock

    listener = in_netns(fabric.host(*ATTACKER), listen)
    try:
        _prefill(fabric, prefill, prompt, "capture-" + uuid.uuid4().hex, (attacker, CAPTURE_PORT))
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(60)
            magic, header_len, payload_len = _PREFIX.unpack(_recv_exact(conn, _PREFIX.size))
            assert magic == MAGIC_MAC  # the prefill instance tags its frames
            header = json.loads(_recv_exact(conn, header_len))
            _recv_exact(conn, payload_len + auth.TAG_BYTES)
            conn.sendall(b"A")
    finally:
        listener.close()
    return header["meta"], payload_len


def _forge(transfer_id: str, meta: dict, payload_len: int, key: bytes | None) -> bytes:
    """The genuine layout, every KV byte zero, tagged with ``key`` (None: untagged)."""
    header = json.dumps({"transfer_id": transfer_id, "meta": meta}).encode()
    payload = bytes(payload_len)
    prefix = _PREFIX.pack(MAGIC if key is None else MAGIC_MAC, len(header), payload_len)
    frame = prefix + header + payload
    if key is not None:
        frame += auth.tag(key, auth.FRAME_LABEL, prefix, header, payload)
    return frame


def _send_frame(fabric, where, frame: bytes) -> bytes:
    """Deliver ``frame`` to the decode listener from host ``where``; its one-byte answer."""

    def send():
        with socket.create_connection((host_ip(*DECODE), DATA_PORT), timeout=30) as sock:
            try:
                sock.sendall(frame)
                return sock.recv(1)
            except (ConnectionResetError, BrokenPipeError):
                return b""

    return in_netns(fabric.host(*where), send)


def _spoof_announcements(fabric) -> int:
    """From the configured peer's own address and port: untagged and wrongly tagged."""
    attacker = host_ip(*ATTACKER)
    now = time.monotonic()
    lie = Transfer("spoofed", attacker, host_ip(*DECODE), 10**12, now, now + 60, 41000,
                   DATA_PORT, spine=0)  # fmt: skip
    body = encode(f"{attacker}:{ANNOUNCE_PORT}", "announce", [lie], now=now)
    datagrams = [body, body + auth.tag(WRONG_KEY, auth.ANNOUNCE_LABEL, body)]

    def send():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.bind((attacker, ANNOUNCE_PORT))
            for datagram in datagrams:
                sock.sendto(datagram, (host_ip(*PREFILL), ANNOUNCE_PORT))

    in_netns(fabric.host(*ATTACKER), send)
    return len(datagrams)


def _labelled(server, name: str, reason: str) -> float:
    text = server.get("/metrics")
    match = re.search(rf'^{re.escape(name)}\{{[^}}]*reason="{reason}"[^}}]*\}} ([0-9.e+]+)$',
                      text, re.MULTILINE)  # fmt: skip
    return float(match.group(1)) if match else 0.0


def test_forged_frames_and_spoofed_announcements_change_no_answer(pd):
    fabric, prefill, decode = pd
    rng = np.random.default_rng(3)
    live, orphan = (rng.integers(100, 40000, size=160).tolist() for _ in range(2))
    alone = {
        "live": _tokens(_post(fabric, CLIENT, prefill.base_url + "/v1/completions", _body(live))),
        "orphan": _tokens(_post(fabric, CLIENT, prefill.base_url + "/v1/completions",
                                _body(orphan))),
    }  # fmt: skip
    meta, payload_len = _capture_genuine_frame(fabric, prefill, live)
    sent = _spoof_announcements(fabric)

    transfer = "live-" + uuid.uuid4().hex
    forged = [_forge(transfer, meta, payload_len, WRONG_KEY), _forge(transfer, meta,
                                                                     payload_len, None)]
    # "A" is the listener's ack of a frame it kept; a refused one gets "N" or a closed socket
    assert _send_frame(fabric, ATTACKER, forged[0]) != b"A"
    _prefill(fabric, prefill, live, transfer, (host_ip(*DECODE), DATA_PORT))
    time.sleep(1.0)  # the genuine frame has landed: a forgery now would replace it
    assert [_send_frame(fabric, ATTACKER, frame) != b"A" for frame in forged] == [True, True]
    # not a listed sender: closed before a byte is read
    assert _send_frame(fabric, CLIENT, forged[0]) != b"A"
    assert _decode(fabric, decode, live, transfer) == alone["live"]

    # only a forged frame ever arrives for this one: the decode side recomputes it
    transfer = "orphan-" + uuid.uuid4().hex
    assert _send_frame(fabric, ATTACKER, _forge(transfer, meta, payload_len, WRONG_KEY)) != b"A"
    assert _decode(fabric, decode, orphan, transfer) == alone["orphan"]

    # a plain request per server publishes its worker's counters with the next step's stats
    for server in (prefill, decode):
        _post(fabric, CLIENT, server.base_url + "/v1/completions", _body([1000, 2000, 3000]))
    assert wait_for_metric(decode, "vllm_ext:ark_frames_unauthenticated_total",
                           lambda v: v >= 4) == 4  # fmt: skip
    assert wait_for_metric(decode, "vllm_ext:ark_frames_unknown_sender_total",
                           lambda v: v >= 1) == 1  # fmt: skip
    assert wait_for_metric(decode, "vllm_ext:ark_load_timeouts_total", lambda v: v >= 1) == 1
    assert wait_for_metric(decode, "vllm_ext:ark_transfers_received_total",
                           lambda v: v >= 1) == 1  # fmt: skip
    name = "vllm_ext:ark_announcements_dropped_total"
    deadline = time.monotonic() + 30
    while _labelled(prefill, name, "bad_mac") < sent and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _labelled(prefill, name, "bad_mac") == sent
    assert wait_for_metric(prefill, "vllm_ext:ark_announcements_received_total",
                           lambda v: True, timeout_s=1.0) in (None, 0.0)  # fmt: skip
