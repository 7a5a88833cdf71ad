"""LeapConfig: defaults, env/mapping loading, every rule names its field, layer resolution."""

from __future__ import annotations

import dataclasses

import pytest

from vllm_ext.common.config import ConfigError, config_table
from vllm_ext.leap.config import LeapConfig, load_leap_config


def test_defaults_match_the_spec():
    cfg = load_leap_config(environ={})
    assert cfg == LeapConfig()
    assert (cfg.layer, cfg.pooling, cfg.weights_path, cfg.prior) == (
        None,
        "last",
        None,
        "prompt_length",
    )
    assert (cfg.forgetting, cfg.rls_init_scale, cfg.ridge_alpha) == (0.999, 1.0, 1.0)
    assert (cfg.max_wait_s, cfg.risk_k, cfg.prediction_timeout_s) == (30.0, 0.0, 1.0)
    assert (cfg.checkpoint_every, cfg.max_len, cfg.online_rls) == (64, 8192, True)


def test_env_and_mapping():
    env = {
        "VLLM_EXT_LEAP_LAYER": "7",
        "VLLM_EXT_LEAP_PRIOR": "fcfs",
        "VLLM_EXT_LEAP_ONLINE_RLS": "false",
        "VLLM_EXT_LEAP_FORGETTING": "0.99",
    }
    cfg = load_leap_config({"forgetting": 1}, environ=env)
    assert cfg.layer == 7 and cfg.prior == "fcfs" and cfg.online_rls is False
    assert cfg.forgetting == 1.0


def test_unknown_key_is_an_error():
    with pytest.raises(ConfigError, match="'risk'"):
        load_leap_config({"risk": 1.0}, environ={})


@pytest.mark.parametrize(
    "field, value",
    [
        ("layer", -1),
        ("layer", True),
        ("pooling", "max"),
        ("weights_path", ""),
        ("checkpoint_every", 0),
        ("online_rls", 1),
        ("forgetting", 0.0),
        ("forgetting", 1.0001),
        ("forgetting", float("nan")),
        ("rls_init_scale", 0.0),
        ("ridge_alpha", -0.1),
        ("probe_slots", -1),
        ("refine_every", 0),
        ("refine_weights_path", ""),
        ("probe_slots", 1.5),
        ("ridge_alpha", float("nan")),
        ("max_wait_s", 0.0),
        ("max_wait_s", float("inf")),
        ("risk_k", -1.0),
        ("prior", "sjf"),
        ("remaining", "mean"),
        ("error_log_std", 0.0),
        ("error_log_std", float("nan")),
        ("prediction_timeout_s", -1.0),
        ("max_len", 0),
        ("max_len", 10.5),
        ("rls_thread", "yes"),
    ],
)
def test_bad_value_names_the_field(field, value):
    with pytest.raises(ConfigError, match=rf"LeapConfig\.{field}"):
        LeapConfig(**{field: value})


def test_config_is_frozen_and_documented():
    cfg = LeapConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.layer = 3
    table = config_table(LeapConfig, "leap")
    for f in dataclasses.fields(LeapConfig):
        assert f.metadata["doc"] and f"`VLLM_EXT_LEAP_{f.name.upper()}`" in table


def test_decode_probes_are_sent_only_when_something_reads_them():
    assert LeapConfig().decode_probe_every == 0
    assert LeapConfig(refine_weights_path="r.npz", refine_every=16).decode_probe_every == 16
    assert LeapConfig(return_probe=True).decode_probe_every == 32


def test_rls_runs_in_the_background_on_accelerators_unless_told():
    assert LeapConfig().rls_in_background(on_cpu=False)
    assert not LeapConfig().rls_in_background(on_cpu=True)
    assert LeapConfig(rls_thread=True).rls_in_background(on_cpu=True)
    assert not LeapConfig(rls_thread=False).rls_in_background(on_cpu=False)
    env = {"VLLM_EXT_LEAP_RLS_THREAD": "true"}
    assert load_leap_config(environ=env).rls_thread is True


@pytest.mark.parametrize("num_layers, expected", [(1, 0), (2, 1), (30, 15), (31, 15)])
def test_resolve_layer_defaults_to_mid_depth(num_layers, expected):
    assert LeapConfig().resolve_layer(num_layers) == expected


def test_resolve_layer_range():
    assert LeapConfig(layer=29).resolve_layer(30) == 29
    with pytest.raises(ConfigError, match=r"layer=30 is out of range .* 30 layers"):
        LeapConfig(layer=30).resolve_layer(30)
    with pytest.raises(ConfigError, match="num_layers"):
        LeapConfig().resolve_layer(0)


def test_probes_are_delivered_a_step_late_on_cuda_unless_told_or_calibrating():
    assert LeapConfig().probe_deferred(on_cuda=True)
    assert not LeapConfig().probe_deferred(on_cuda=False)
    assert not LeapConfig(return_probe=True).probe_deferred(on_cuda=True)
    assert LeapConfig(probe_delivery="next_step").probe_deferred(on_cuda=False)
    assert not LeapConfig(probe_delivery="same_step").probe_deferred(on_cuda=True)
    with pytest.raises(ConfigError, match="probe_delivery"):
        LeapConfig(probe_delivery="later")
