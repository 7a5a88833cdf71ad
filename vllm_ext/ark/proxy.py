"""A small P/D proxy for ArkConnector (stdlib only).

For each completion request: a transfer id, then the prefill instance with
``max_tokens = 1`` and ``kv_transfer_params = {"do_remote_decode": true,
"transfer_id", "remote_host", "remote_port"}`` (the decode instance's KV
listener), then the decode instance with the original body and
``{"do_remote_prefill": true, "transfer_id"}``; the decode answer goes back to
the client. With ``--nixl`` (vLLM's NIXL connector, or ``ArkNixlConnector``) the
prefill request asks ``{"do_remote_decode": true}`` and the ``kv_transfer_params``
of its answer (where the decode side pulls the KV from) go to the decode request
as they are. Non-streaming requests only. Other paths go to the decode instance.

Run: ``python -m vllm_ext.ark.proxy --prefill http://P:8000 --decode http://D:8001
--decode-kv 10.0.1.5:7100 --port 9000`` (or ``--nixl`` instead of ``--decode-kv``).
"""

from __future__ import annotations

import argparse
import json
import urllib.error
import urllib.request
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from vllm_ext.ark.config import parse_endpoint

ROUTES = ("/v1/completions", "/v1/chat/completions")


def _post(url: str, body: dict, timeout: float) -> tuple[int, bytes]:
    request = urllib.request.Request(url, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


# what vLLM's NIXL connector expects of a prefill request that a decode instance will pull
NIXL_PREFILL = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                "remote_block_ids": None, "remote_host": None, "remote_port": None}  # fmt: skip


def make_handler(prefill: str, decode: str, decode_kv: tuple[str, int] | None,
                 timeout: float = 600.0):  # fmt: skip
    """Handler class; ``decode_kv=None`` selects the NIXL protocol."""

    class Handler(BaseHTTPRequestHandler):
        def _reply(self, status: int, data: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length", 0))
            try:
                body = json.loads(self.rfile.read(length) or b"{}")
            except json.JSONDecodeError:
                return self._reply(400, b'{"error": "body is not JSON"}')
            if self.path not in ROUTES or body.get("stream"):
                return self._reply(400, b'{"error": "only non-streaming completions"}')
            transfer_id = uuid.uuid4().hex
            if decode_kv is None:
                params = dict(NIXL_PREFILL)
            else:
                params = {"do_remote_decode": True, "transfer_id": transfer_id,
                          "remote_host": decode_kv[0], "remote_port": decode_kv[1]}  # fmt: skip
            first = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": params}
            first.pop("max_completion_tokens", None)
            status, data = _post(prefill + self.path, first, timeout)
            if status != 200:
                return self._reply(status, data)
            if decode_kv is None:
                remote = json.loads(data).get("kv_transfer_params")
                if not isinstance(remote, dict):
                    return self._reply(502, b'{"error": "no kv_transfer_params from prefill"}')
            else:
                remote = {"do_remote_prefill": True, "transfer_id": transfer_id}
            self._reply(*_post(decode + self.path, {**body, "kv_transfer_params": remote}, timeout))

        def do_GET(self) -> None:
            try:
                with urllib.request.urlopen(decode + self.path, timeout=timeout) as resp:
                    self._reply(resp.status, resp.read())
            except urllib.error.HTTPError as exc:
                self._reply(exc.code, exc.read())

        def log_message(self, format, *args) -> None:  # noqa: A002 - stdlib signature
            pass

    return Handler


def serve(host: str, port: int, prefill: str, decode: str,
          decode_kv: tuple[str, int] | None) -> ThreadingHTTPServer:  # fmt: skip
    """A started-on-demand server (call ``serve_forever``; ``server_address`` has the port)."""
    return ThreadingHTTPServer((host, port), make_handler(prefill, decode, decode_kv))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefill", required=True, help="prefill server URL")
    parser.add_argument("--decode", required=True, help="decode server URL")
    kv = parser.add_mutually_exclusive_group(required=True)
    kv.add_argument("--decode-kv", help="ArkConnector: decode KV listener host:port")
    kv.add_argument("--nixl", action="store_true", help="NIXL connector protocol")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9000)
    args = parser.parse_args(argv)
    server = serve(args.host, args.port, args.prefill.rstrip("/"), args.decode.rstrip("/"),
                   None if args.nixl else parse_endpoint(args.decode_kv))  # fmt: skip
    server.serve_forever()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
