"""Servers for the e2e tier: one ``vllm serve`` subprocess per module, on loopback."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# small KV, no compilation: start-up in well under a minute on 2 cores
SERVE_ARGS = [
    "--enforce-eager",
    "--kv-cache-memory-bytes",
    str(256 << 20),
    "--max-model-len",
    "2048",
    "--max-num-seqs",
    "8",
]


def server_env() -> dict[str, str]:
    # the counting connector is imported from tests/ inside EngineCore and worker; entries
    # already on PYTHONPATH stay behind it (make mutants puts its sitecustomize there)
    path = os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))
    return {"PYTHONPATH": path, "VLLM_LOGGING_LEVEL": "INFO"}


def metric_value(text: str, name: str) -> float | None:
    """The first sample of counter ``name`` on a Prometheus text page."""
    match = re.search(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? ([0-9.e+]+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else None


def wait_for_metric(server, name, predicate, timeout_s=30.0) -> float | None:
    """Poll ``/metrics`` until ``predicate(value)``; connector stats arrive with stats pushes."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = metric_value(server.get("/metrics"), name)
        if (value is not None and predicate(value)) or time.monotonic() > deadline:
            return value
        time.sleep(0.5)


def assert_greedy_chat_reply(client, model: str, tokenizer_path, max_tokens: int = 16):
    """Ask one chat question greedily; check the reply is what greedy decoding must give.

    Which words a 135M bf16 model picks depends on the CPU's bf16 kernels (a
    machine with AVX512-BF16 answered differently from an AVX2 one), so the
    check is numerics-independent: the prompt is the model's chat template
    applied to the message, and every generated token is the most likely one
    under the logprobs the server itself reports.
    """
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    reply = client.chat.completions.create(
        model=model, messages=messages, temperature=0, max_tokens=max_tokens,
        logprobs=True, top_logprobs=5,
    )  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path))
    templated = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(templated, "keys"):  # transformers 5 returns a BatchEncoding
        templated = templated["input_ids"]
    assert reply.usage.prompt_tokens == len(templated)
    choice = reply.choices[0]
    assert choice.message.content and reply.usage.completion_tokens > 0
    steps = choice.logprobs.content
    assert len(steps) == reply.usage.completion_tokens
    for step in steps:
        best = max(alt.logprob for alt in step.top_logprobs)
        assert step.logprob >= best - 1e-6, (step.token, step.logprob, step.top_logprobs)
    return reply
