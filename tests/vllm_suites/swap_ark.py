"""ArkConnector in place of NIXL in vLLM's P/D connector-lifecycle tests.

vLLM's ``tests/v1/kv_connector/unit/test_remote_{prefill,decode}_lifecycle.py``
drive a real ``Scheduler`` through P/D requests' lives (remote prefill: async
load, ``finished_recving``, abort during a load; remote decode: delayed block
free until ``finished_sending``) with NIXL as the connector, built from
``utils.create_vllm_config``. ARK speaks the same P/D flags, so its scheduler
half goes in there: ``create_vllm_config`` builds ``ArkConnector`` (by module
path; ``kv_producer`` for the remote-decode file, whose requests are prefills,
``kv_consumer`` for the rest) and ``create_request`` gives remote-decode requests
the decode address ARK sends to.
"""

from __future__ import annotations

import functools
import sys


def _calling_module() -> str:
    frame = sys._getframe(2)
    return frame.f_globals.get("__name__", "")


def install() -> None:
    from tests.v1.kv_connector.unit import utils

    from vllm_ext.serving import free_port

    create_vllm_config, create_request = utils.create_vllm_config, utils.create_request

    @functools.wraps(create_vllm_config)
    def ark_vllm_config(*args, **kwargs):
        if kwargs.get("kv_connector", "NixlConnector") == "NixlConnector":
            producer = "remote_decode" in _calling_module()
            kwargs.update(kv_connector="ArkConnector",
                          kv_connector_module_path="vllm_ext.ark.connector",
                          kv_role="kv_producer" if producer else "kv_consumer")  # fmt: skip
        config = create_vllm_config(*args, **kwargs)
        if config.kv_transfer_config.kv_connector == "ArkConnector":
            config.additional_config = {"ark": {"announce_port": free_port(),
                                                "data_port": free_port()}}  # fmt: skip
        return config

    @functools.wraps(create_request)
    def ark_request(*args, **kwargs):
        request = create_request(*args, **kwargs)
        params = request.kv_transfer_params
        if params and params.get("do_remote_decode"):
            params.update(remote_host="127.0.0.1", remote_port=7100)
        return request

    utils.create_vllm_config, utils.create_request = ark_vllm_config, ark_request
