#!/usr/bin/env bash
# Flide on SmolLM2-135M-Instruct (CPU): many yes/no questions about one shared context,
# answered in one packed pass — over HTTP on `vllm serve`, then from a JSONL file with the CLI.
set -euo pipefail
MODEL=$(python -c "from vllm_ext.assets import model_path; print(model_path('smollm2'))")
vllm-ext serve "$MODEL" --served-model-name smollm2 --port 8000 \
    --enforce-eager --kv-cache-memory-bytes 268435456 --max-model-len 2048 --plugins flide &
SERVER=$!
trap 'kill -INT $SERVER' EXIT
until curl -sf localhost:8000/health >/dev/null; do sleep 1; done
curl -s localhost:8000/v1/flide/classify -H 'Content-Type: application/json' -d '{
  "labels": [" yes", " no"],
  "items": [{"context": "Support ticket: my March invoice was charged twice; please refund it.",
             "questions": ["Is this about billing? Answer:", "Is this about a login problem? Answer:",
                           {"id": "refund", "text": "Does the customer want a refund? Answer:"}]}]}'
echo
curl -s localhost:8000/metrics | grep '^vllm_ext:flide_'
kill -INT $SERVER; trap - EXIT; wait $SERVER || true

# the same from a file, in-process engine, progress bar on stderr
cat > /tmp/flide_items.jsonl <<'JSONL'
{"context": "The build failed: pytest could not import numpy.", "questions": ["Is it a dependency problem? Answer:", "Is it a network outage? Answer:"]}
{"context": "The login page returns 500 after the deploy.", "questions": ["Is it a server error? Answer:"]}
JSONL
VLLM_ENABLE_V1_MULTIPROCESSING=0 python -m vllm_ext.flide "$MODEL" --input /tmp/flide_items.jsonl \
    --labels " yes" " no" --engine-arg max_model_len=2048 \
    --engine-arg kv_cache_memory_bytes=268435456 --engine-arg enforce_eager=true
