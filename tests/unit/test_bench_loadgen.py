"""Unit tests of the OpenAI load driver against a stub streaming server."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from vllm_ext.bench import Request, assign_arrivals, run_trace_sync, summarize

pytestmark = pytest.mark.unit


class _StubHandler(BaseHTTPRequestHandler):
    """Streams 3 tokens per request; prompts containing FAIL get HTTP 500."""

    seen: list[dict] = []

    def log_message(self, *args: object) -> None:  # silence stderr
        pass

    def do_POST(self) -> None:  # noqa: N802 - http.server API
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).seen.append({"path": self.path, **body})
        text = json.dumps(body.get("messages") or body.get("prompt"))
        if "FAIL" in text:
            self.send_response(500)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b'{"error": {"message": "boom"}}')
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        chat = self.path.endswith("/chat/completions")
        for event in _events(chat):
            if '"b"' in json.dumps(event) or '"c"' in json.dumps(event):
                time.sleep(0.03)  # gap between tokens; none after the last
            self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
            self.wfile.flush()
        self.wfile.write(b"data: [DONE]\n\n")


def _events(chat: bool) -> Iterator[dict]:
    """Chunks of a 3-token completion followed by a usage chunk."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    base = {"id": "x", "object": obj, "created": 0, "model": "m"}
    if chat:
        yield {
            **base,
            "choices": [
                {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
            ],
        }
    for tok in ("a", "b", "c"):
        choice = (
            {"index": 0, "delta": {"content": tok}, "finish_reason": None}
            if chat
            else {"index": 0, "text": tok, "finish_reason": None}
        )
        yield {**base, "choices": [choice]}
    yield {
        **base,
        "choices": [],
        "usage": {
            "prompt_tokens": 7,
            "completion_tokens": 3,
            "total_tokens": 10,
            "prompt_tokens_details": {"cached_tokens": 4},
        },
    }


@pytest.fixture()
def server() -> Iterator[str]:
    """Stub OpenAI server on a free port; yields its base URL."""
    _StubHandler.seen = []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _StubHandler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_run_trace_records_tokens_and_failures(server: str) -> None:
    reqs = [
        Request(
            "r0",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=3,
            extra_body={"ignore_eos": True},
        ),
        Request("r1", prompt="hello", max_tokens=3),
        Request("r2", messages=[{"role": "user", "content": "FAIL"}]),
    ]
    reqs = assign_arrivals(reqs, [0.0, 0.01, 0.02])
    records = run_trace_sync(server, "m", reqs, max_concurrency=2, progress=False)
    assert [r.id for r in records] == ["r0", "r1", "r2"]
    r0, r1, r2 = records
    for rec in (r0, r1):
        assert rec.ok and rec.error is None
        assert (rec.output_tokens, rec.prompt_tokens, rec.cached_tokens) == (3, 7, 4)
        assert rec.ttft_s is not None and 0 <= rec.ttft_s <= rec.latency_s
        assert rec.itl_s is not None and len(rec.itl_s) == 2
        # first-token time + inter-token gaps = last-token time <= end
        assert rec.ttft_s + sum(rec.itl_s) <= rec.latency_s + 1e-9
    assert not r2.ok and "500" in r2.error and r2.ttft_s is None
    sent = {json.dumps(s.get("messages") or s.get("prompt")): s for s in _StubHandler.seen}
    chat = sent[json.dumps([{"role": "user", "content": "hi"}])]
    assert chat["path"] == "/v1/chat/completions"
    assert chat["stream"] is True and chat["ignore_eos"] is True
    assert chat["stream_options"] == {"include_usage": True}
    assert chat["temperature"] == 0 and chat["max_tokens"] == 3
    assert sent['"hello"']["path"] == "/v1/completions"
    summary = summarize(records)
    assert summary["ok_count"] == 2 and summary["error_count"] == 1
    assert summary["output_tokens_total"] == 6
    assert summary["prefix_cache_hit_rate"] == pytest.approx(8 / 14)


def test_unreachable_server_records_errors() -> None:
    reqs = [Request(f"r{i}", prompt="x") for i in range(2)]
    records = run_trace_sync("http://127.0.0.1:9/v1", "m", reqs, progress=False, timeout_s=5)
    assert all(not r.ok and r.error for r in records)


def test_request_validation() -> None:
    with pytest.raises(ValueError):
        Request("x")
    with pytest.raises(ValueError):
        Request("x", prompt="a", messages=[{"role": "user", "content": "b"}])
    with pytest.raises(ValueError):
        Request("x", prompt="a", arrival_s=-1.0)
    with pytest.raises(ValueError):
        run_trace_sync("http://127.0.0.1:9", "m", [], max_concurrency=0)
    assert run_trace_sync("http://127.0.0.1:9", "m", [], progress=False) == []
