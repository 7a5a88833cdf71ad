"""``python -m vllm_ext.flide``: a JSONL file in, one result line per item out (real engine)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from vllm_ext.assets import model_path

REPO = Path(__file__).resolve().parents[2]


def test_cli_classifies_a_jsonl_file_and_reports_bad_lines(tmp_path):
    items = [
        {"context": "The invoice was charged twice.", "questions": ["Billing?", "Login?"]},
        "not an object",
        {"context": "Password reset fails.", "questions": [{"id": "q", "text": "Login?"}]},
    ]
    source = tmp_path / "items.jsonl"
    source.write_text("\n".join(json.dumps(item) for item in items) + "\n")
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "vllm_ext.flide", str(model_path("tiny-llama")),
           "--input", str(source), "--output", str(out), "--labels", " yes", " no",
           "--engine-arg", "max_model_len=512", "--engine-arg", f"kv_cache_memory_bytes={64 << 20}",
           "--engine-arg", "enforce_eager=true"]  # fmt: skip
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONPATH": str(REPO)}
    done = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 1, done.stderr[-3000:]  # one bad line
    assert "flide items" in done.stderr  # the progress bar
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["line"] for r in records] == [1, 2, 3]
    assert [r["id"] for r in records[0]["results"]] == ["0", "1"]
    assert "must be a JSON object" in records[1]["error"]
    assert records[2]["results"][0]["id"] == "q"
    for result in records[0]["results"] + records[2]["results"]:
        assert result["label"] in (" yes", " no")
        assert abs(sum(result["probs"].values()) - 1) < 1e-6
