"""ArkConfig: defaults, env and mapping precedence, clear errors naming the key."""

from __future__ import annotations

import pytest

from vllm_ext.ark.config import ArkConfig, load_ark_config
from vllm_ext.common.config import ConfigError, env_var_name

pytestmark = pytest.mark.unit


def test_defaults_and_candidates():
    cfg = load_ark_config({}, environ={})
    assert cfg == ArkConfig()
    assert cfg.candidates == tuple(range(40000, 40016))


def test_mapping_beats_environment():
    env = {env_var_name("ark", "port_count"): "4", env_var_name("ark", "peers"): "10.0.0.2:7200"}
    cfg = load_ark_config({"port_count": 8}, environ=env)
    assert cfg.port_count == 8 and cfg.peers == ("10.0.0.2:7200",)


@pytest.mark.parametrize("mapping, match", [
    ({"host": "example.com"}, "host must be an IPv4"),
    ({"data_port": 0}, "data_port"),
    ({"port_base": 65530, "port_count": 16}, "port_count"),
    ({"peers": ["nohost"]}, "not 'host:port'"),
    ({"min_bytes": -1}, "min_bytes"),
    ({"link_gbps": 0.0}, "link_gbps"),
    ({"load_timeout_s": float("nan")}, "load_timeout_s"),
    ({"port_cont": 3}, "unknown key 'port_cont'"),
])  # fmt: skip
def test_bad_values_name_the_key(mapping, match):
    with pytest.raises(ConfigError, match=match):
        load_ark_config(mapping, environ={})
