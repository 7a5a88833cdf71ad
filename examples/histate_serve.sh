#!/usr/bin/env bash
# HiState on the tiny Qwen3-Next hybrid (CPU): serve with --plugins histate, send a long prompt,
# drop vLLM's device prefix cache, send it again: the prefix comes back from HiState's tiers.
set -euo pipefail
MODEL=$(python -m vllm_ext.assets --path tiny-hybrid)
export VLLM_SERVER_DEV_MODE=1                      # POST /reset_prefix_cache
SSD=${SSD:-/tmp/histate-ssd}
# one-block prefill chunks: on vLLM 0.32's multiprocess engine other chunks miss block boundaries;
# bf16 SSM state keeps the block at 384 tokens (vLLM picks float32, 640, on AVX-512-BF16 CPUs)
vllm-ext serve "$MODEL" --served-model-name tiny --port 8000 --enforce-eager \
    --kv-cache-memory-bytes 256M --max-model-len 2048 --max-num-batched-tokens 384 \
    --mamba-ssm-cache-dtype bfloat16 --plugins histate \
    --additional-config "{\"histate\": {\"host_bytes\": $((256 << 20)), \"directory\": \"$SSD\"}}" &
SERVER=$!
trap 'kill -INT $SERVER' EXIT
until curl -sf localhost:8000/health >/dev/null; do sleep 1; done
PROMPT=$(python -c "import random; r = random.Random(11); print([r.randrange(100, 30000) for _ in range(900)])")
ask() { curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' \
    -d "{\"model\": \"tiny\", \"prompt\": $PROMPT, \"max_tokens\": 8, \"temperature\": 0}" \
    | python -c "import json, sys; print(json.load(sys.stdin)['choices'][0]['text'])"; }
ask
curl -s -X POST localhost:8000/reset_prefix_cache
ask
sleep 2  # counters reach /metrics with the next stats push
curl -s localhost:8000/metrics | grep -E '^vllm_ext:histate_(hit|snapshots_loaded|kv_blocks)'
