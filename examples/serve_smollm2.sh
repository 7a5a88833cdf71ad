#!/usr/bin/env bash
# Serve SmolLM2-135M-Instruct on CPU through vllm-ext, then ask it one question.
# Systems join with --plugins as they land; `vllm-ext serve --help` lists them.
set -euo pipefail
MODEL=$(python -m vllm_ext.assets --path smollm2)
vllm-ext serve "$MODEL" --served-model-name smollm2 --port 8000 \
    --enforce-eager --kv-cache-memory-bytes 512M --max-model-len 4096 &
SERVER=$!
trap 'kill -INT $SERVER' EXIT
until curl -sf localhost:8000/health >/dev/null; do sleep 1; done
curl -s localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \
    -d '{"model": "smollm2", "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 16, "temperature": 0}'
echo
