"""ARK's sender checks and HMAC tags through ArkConnector's workers on vLLM 0.34's own code.

Both workers are created the way 0.34 creates them after warm-up (``connectors034``), with
the same ``secret_file`` and the decode side's ``kv_senders`` set. A frame forged for the
live transfer (another key) is dropped and the decode cache receives the genuine blocks; a
sender without the secret gets its frame refused and the decode side reports the blocks as
load errors, so 0.34 recomputes them (``kv_load_failure_policy: recompute``).
"""

from __future__ import annotations

import json
import socket
import struct
import time

import pytest

pytest.importorskip("tests.v1.kv_connector.unit.utils")

import torch
from connectors034 import ark_config, worker_after_warm_up

from vllm_ext.ark import auth
from vllm_ext.ark.connector import ArkMetadata, LoadJob, SendJob
from vllm_ext.ark.transport import MAGIC_MAC
from vllm_ext.serving import free_port

SECRET = "0123456789abcdef0123456789abcdef"


def _pair(tmp_path, sender_secret: bool):
    key = tmp_path / "ark.secret"
    key.write_text(SECRET + "\n")
    key.chmod(0o600)
    ark = {"secret_file": str(key)}
    prefill = ark_config("kv_producer", **(ark if sender_secret else {}))
    decode = ark_config("kv_consumer", kv_senders=["127.0.0.1"], **ark)
    sender, src = worker_after_warm_up(prefill, 23, 40)
    receiver, dst = worker_after_warm_up(decode, 29, 40)
    return sender, src, receiver, dst, decode.additional_config["ark"]["data_port"]


def _send(sender, src, port) -> None:
    torch.manual_seed(0)
    for tensor in src.values():
        tensor.copy_(torch.randn_like(tensor))
    sender.bind_connector_metadata(
        ArkMetadata(sends=[SendJob("r1", "t-1", (3, 7, 11), ("127.0.0.1", port), free_port())])
    )
    sender.start_load_kv(None)
    sender.wait_for_save()
    sender.clear_connector_metadata()


def _load(receiver):
    receiver.bind_connector_metadata(ArkMetadata(loads=[LoadJob("r1", "t-1", (5, 2, 20), 0)]))
    receiver.start_load_kv(None)
    receiver.clear_connector_metadata()
    deadline = time.monotonic() + 20
    results = receiver.get_transfer_results(set())
    while not results.finished_recving and time.monotonic() < deadline:
        time.sleep(0.05)
        results = receiver.get_transfer_results(set())
    return results


def _forge(port: int) -> bytes:
    """A tagged frame for the live transfer id, tagged with another key; its one-byte answer."""
    header = json.dumps({"transfer_id": "t-1", "meta": {"layers": []}}).encode()
    payload = bytes(64)
    prefix = struct.pack("!4sIQ", MAGIC_MAC, len(header), len(payload))
    mac = auth.tag(b"another key, not the secret....", auth.FRAME_LABEL, prefix, header, payload)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(prefix + header + payload + mac)
        return sock.recv(1)


def test_a_forged_frame_is_dropped_and_the_genuine_kv_is_loaded(tmp_path):
    sender, src, receiver, dst, port = _pair(tmp_path, sender_secret=True)
    try:
        _send(sender, src, port)
        time.sleep(0.5)
        assert _forge(port) == b"N"
        assert _load(receiver).finished_recving == {"r1"}
        assert receiver.get_block_ids_with_load_errors() == set()
        for name, tensor in dst.items():
            assert torch.equal(tensor[[5, 2, 20]], src[name][[3, 7, 11]]), name
        assert receiver.counters.value("frames_unauthenticated") == 1
        assert receiver.counters.value("transfers_received") == 1
    finally:
        sender.shutdown()
        receiver.shutdown()


def test_a_sender_without_the_secret_is_refused_and_the_blocks_are_recomputed(tmp_path):
    sender, src, receiver, dst, port = _pair(tmp_path, sender_secret=False)
    try:
        _send(sender, src, port)
        assert _load(receiver).finished_recving == {"r1"}  # after load_timeout_s (5 s)
        assert receiver.get_block_ids_with_load_errors() == {5, 2, 20}
        assert receiver.counters.value("frames_unauthenticated") == 1
        assert receiver.counters.value("load_timeouts") == 1
        assert all(not tensor.any() for tensor in dst.values())
    finally:
        sender.shutdown()
        receiver.shutdown()
