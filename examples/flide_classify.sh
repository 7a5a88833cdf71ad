#!/usr/bin/env bash
# Flide on SmolLM2-135M-Instruct (CPU): restaurant reviews after one shared few-shot header,
# answered in one packed pass — over HTTP on `vllm serve`, then from a JSONL file with the CLI.
set -euo pipefail
MODEL=$(python -m vllm_ext.assets --path smollm2)
vllm-ext serve "$MODEL" --served-model-name smollm2 --port 8000 \
    --enforce-eager --kv-cache-memory-bytes 256M --max-model-len 2048 --plugins flide &
SERVER=$!
trap 'kill -INT $SERVER' EXIT
until curl -sf localhost:8000/health >/dev/null; do sleep 1; done
curl -s localhost:8000/v1/flide/classify -H 'Content-Type: application/json' -d '{
  "labels": [" positive", " negative"],
  "items": [{"context": "Classify each restaurant review as positive or negative.\n\nReview: The pasta was wonderful and the waiter was kind.\nSentiment: positive\n\nReview: The soup was cold and the staff were rude.\nSentiment: negative\n\n",
             "questions": ["Review: Best pizza I have ever had!\nSentiment:",
                           {"id": "steak", "text": "Review: We waited an hour and the steak was burnt.\nSentiment:"}]}]}'
echo
curl -s localhost:8000/metrics | grep '^vllm_ext:flide_'
kill -INT $SERVER; trap - EXIT; wait $SERVER || true

# the same from a file, in-process engine, progress bar on stderr
cat > /tmp/flide_items.jsonl <<'JSONL'
{"context": "Classify each restaurant review as positive or negative.\n\nReview: The pasta was wonderful and the waiter was kind.\nSentiment: positive\n\nReview: The soup was cold and the staff were rude.\nSentiment: negative\n\n", "questions": ["Review: Lovely place, we will come back soon.\nSentiment:", "Review: The fish smelled bad and I felt sick.\nSentiment:"]}
JSONL
VLLM_ENABLE_V1_MULTIPROCESSING=0 python -m vllm_ext.flide "$MODEL" --input /tmp/flide_items.jsonl \
    --labels " positive" " negative" --engine-arg max_model_len=2048 \
    --engine-arg kv_cache_memory_bytes=268435456 --engine-arg enforce_eager=true
