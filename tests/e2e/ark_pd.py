"""What the ARK P/D end-to-end modules share: the connector config, the proxy's lifetime."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from http.server import HTTPServer

from vllm_ext.serving import VllmServer, start_together


def ark_kv_config(role: str) -> str:
    """``--kv-transfer-config`` for an ArkConnector instance (the consumer recomputes lost KV)."""
    config = {"kv_connector": "ArkConnector", "kv_connector_module_path":
              "vllm_ext.ark.connector", "kv_role": role}  # fmt: skip
    if role == "kv_consumer":
        config["kv_load_failure_policy"] = "recompute"
    return json.dumps(config)


def serving_in_thread(httpd: HTTPServer) -> HTTPServer:
    """``httpd``, answering from a daemon thread."""
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


@contextmanager
def pd_behind_proxy(
    servers: Sequence[VllmServer], start_proxy: Callable[..., HTTPServer]
) -> Iterator[HTTPServer]:
    """Start ``servers`` (prefill, decode) together, then ``start_proxy(prefill, decode)``.

    Yields the proxy, already serving; on exit stops it and every server, whichever failed.
    """
    errors = start_together(servers)
    proxy = None
    try:
        if errors:
            raise errors[0]
        proxy = start_proxy(*servers)
        yield proxy
    finally:
        if proxy is not None:
            proxy.shutdown()
            proxy.server_close()
        for server in servers:
            server.stop()
