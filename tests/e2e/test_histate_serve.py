"""`vllm-ext serve --plugins histate`: a prefix restored from HiState answers like the first time.

One real server (tiny Qwen3-Next hybrid, multiprocess engine: the connector's
scheduler half in EngineCore, its page copies in the worker process, the
counters in the API server). The same long prompt is sent twice with vLLM's
device prefix cache reset in between (``POST /reset_prefix_cache``, a dev-mode
route); the second answer equals the first and HiState's counters show the hit.
Served as a new user types it (``--plugins histate`` and the memory flag only),
the start-up refuses with the flag to pass instead of storing nothing.
"""

from __future__ import annotations

import json
import re
import urllib.request

import numpy as np
import pytest

from tests.e2e.conftest import SERVE_ARGS, metric_value, server_env, wait_for_metric
from vllm_ext.assets import model_path
from vllm_ext.serving import ServerError, VllmServer

PROMPT = np.random.default_rng(11).integers(100, 30000, size=900).tolist()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "histate.log"
    env = {**server_env(), "VLLM_SERVER_DEV_MODE": "1"}  # exposes POST /reset_prefix_cache
    histate = {"directory": str(tmp_path_factory.mktemp("histate-ssd")), "host_bytes": 256 << 20}
    # chunks of one block: in vLLM 0.32's multiprocess engine the EngineCore keeps
    # mamba_block_size=16 (the platform raises it to 384 only in the worker), so longer
    # chunks do not end on 384-token boundaries and no boundary state exists to store
    # bf16 SSM state: 384-token blocks on every CPU (float32 state, vLLM's choice on
    # AVX-512-BF16 CPUs, makes them 640)
    args = [*SERVE_ARGS, "--served-model-name", "tiny", "--plugins", "histate",
            "--max-num-batched-tokens", "384", "--mamba-ssm-cache-dtype", "bfloat16",
            "--additional-config", json.dumps({"histate": histate})]  # fmt: skip
    with VllmServer(
        str(model_path("tiny-hybrid")), args, launcher="vllm-ext", env=env, log_path=log
    ) as srv:
        yield srv


def _complete(client) -> list:
    reply = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=1
    )
    return reply.choices[0].logprobs.tokens


def test_restored_prefix_answers_identically_and_is_counted(server):
    from openai import OpenAI

    client = OpenAI(base_url=server.base_url + "/v1", api_key="EMPTY")
    first = _complete(client)
    stored = wait_for_metric(server, "vllm_ext:histate_kv_blocks_stored_total", lambda v: v >= 2)
    assert stored is not None and stored >= 2
    request = urllib.request.Request(server.base_url + "/reset_prefix_cache", method="POST")
    with urllib.request.urlopen(request, timeout=60) as resp:
        assert resp.status == 200
    second = _complete(client)
    assert second == first
    # 899 tokens can hit at most 768 (two 384-token blocks); HiState served them
    hit = wait_for_metric(server, "vllm_ext:histate_hit_tokens_total", lambda v: v >= 768)
    assert hit == 768
    text = server.get("/metrics")
    assert metric_value(text, "vllm_ext:histate_snapshots_loaded_host_total") == 1
    assert "# HELP vllm_ext:histate_ssd_corrupt_total" in text
    # the gauges and the histogram users graph: tier occupancy, restore latency
    assert "# TYPE vllm_ext:histate_tier_used_bytes gauge" in text
    host = re.search(r'^vllm_ext:histate_tier_used_bytes\{[^}]*tier="host"[^}]*\} (\S+)$', text,
                     re.MULTILINE)  # fmt: skip
    assert host is not None and float(host.group(1)) > 0, text
    capacity = re.search(r'^vllm_ext:histate_tier_capacity_bytes\{[^}]*tier="host"[^}]*\} (\S+)$',
                         text, re.MULTILINE)  # fmt: skip
    assert capacity is not None and float(capacity.group(1)) == 256 << 20
    assert "# TYPE vllm_ext:histate_restore_seconds histogram" in text
    assert metric_value(text, "vllm_ext:histate_restore_seconds_count") == 1


def test_plain_plugins_histate_refuses_naming_the_flag(tmp_path):
    # vLLM's default chunk limit (2048) does not end chunks on the hybrid block's
    # boundaries when the worker runs in its own process (vLLM's default, which
    # tests/conftest.py turns off): HiState would store KV but never a state
    env = {**server_env(), "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    histate = {"directory": str(tmp_path / "ssd"), "host_bytes": 64 << 20}
    config = json.dumps({"histate": histate})
    args = [*SERVE_ARGS, "--plugins", "histate", "--additional-config", config]
    server = VllmServer(
        str(model_path("tiny-hybrid")), args, launcher="vllm-ext", env=env,
        log_path=tmp_path / "refused.log",
    )  # fmt: skip
    with pytest.raises(ServerError) as refused:
        server.start()
    server.stop()
    block = re.search(r"pass --max-num-batched-tokens (\d+)", str(refused.value))
    assert block is not None, server.log_tail()
    assert int(block.group(1)) in (384, 640)  # bf16 or float32 state, by CPU
    assert "HiState needs prefill chunks that end on the" in str(refused.value)
