#!/usr/bin/env bash
# LEAP on SmolLM2-135M-Instruct (CPU): calibrate the length predictor on the serving model,
# serve with `--plugins leap`, ask one question, show the prediction and LEAP's counters.
# (`python -m vllm_ext.assets leap-smollm2` builds the same weights as a checksummed asset.)
set -euo pipefail
MODEL=$(python -m vllm_ext.assets --path smollm2)
WEIGHTS=${WEIGHTS:-leap-smollm2-weights.npz}
if [ ! -f "$WEIGHTS" ]; then
    # ~1-3 min on 2 cores: greedy generations of 96 ShareGPT first turns, ridge fit on their lengths;
    # the held-out quality report lands beside the weights (.json)
    VLLM_ENABLE_V1_MULTIPROCESSING=0 python -m vllm_ext.leap.calibrate --model "$MODEL" \
        --out "$WEIGHTS" --prompts sharegpt --num-prompts 96 --max-tokens 128 --seed 0
fi
vllm-ext serve "$MODEL" --served-model-name smollm2 --port 8000 \
    --enforce-eager --kv-cache-memory-bytes 512M --max-model-len 4096 \
    --plugins leap --additional-config "{\"leap\": {\"weights_path\": \"$(realpath "$WEIGHTS")\"}}" &
SERVER=$!
trap 'kill -INT $SERVER' EXIT
until curl -sf localhost:8000/health >/dev/null; do sleep 1; done
# the response's kv_transfer_params.leap holds predicted_tokens and output_tokens
curl -s localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \
    -d '{"model": "smollm2", "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 16, "temperature": 0}'
echo
sleep 2  # counters reach /metrics with the next stats push
curl -s localhost:8000/metrics | grep '^vllm_ext:leap_'
