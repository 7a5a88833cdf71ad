"""A small P/D proxy for ArkConnector (stdlib only).

For each completion request: a transfer id, then the prefill instance with
``max_tokens = 1`` and ``kv_transfer_params = {"do_remote_decode": true,
"transfer_id", "remote_host", "remote_port"}`` (the decode instance's KV
listener), then the decode instance with the original body and
``{"do_remote_prefill": true, "transfer_id"}``; the decode answer goes back to
the client. Non-streaming requests only. Other paths go to the decode instance.

Run: ``python -m vllm_ext.ark.proxy --prefill http://P:8000 --decode http://D:8001
--decode-kv 10.0.1.5:7100 --port 9000``.
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


def make_handler(prefill: str, decode: str, decode_kv: tuple[str, int], timeout: float = 600.0):
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
            first = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": {
                "do_remote_decode": True, "transfer_id": transfer_id,
                "remote_host": decode_kv[0], "remote_port": decode_kv[1]}}  # fmt: skip
            first.pop("max_completion_tokens", None)
            status, data = _post(prefill + self.path, first, timeout)
            if status != 200:
                return self._reply(status, data)
            second = {**body, "kv_transfer_params": {"do_remote_prefill": True,
                                                     "transfer_id": transfer_id}}  # fmt: skip
            self._reply(*_post(decode + self.path, second, timeout))

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
          decode_kv: tuple[str, int]) -> ThreadingHTTPServer:  # fmt: skip
    """A started-on-demand server (call ``serve_forever``; ``server_address`` has the port)."""
    return ThreadingHTTPServer((host, port), make_handler(prefill, decode, decode_kv))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefill", required=True, help="prefill server URL")
    parser.add_argument("--decode", required=True, help="decode server URL")
    parser.add_argument("--decode-kv", required=True, help="decode KV listener host:port")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9000)
    args = parser.parse_args(argv)
    server = serve(args.host, args.port, args.prefill.rstrip("/"), args.decode.rstrip("/"),
                   parse_endpoint(args.decode_kv))  # fmt: skip
    server.serve_forever()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
