"""LeapConfig: defaults, env/block loading, public/experimental keys, every rule names its field,
layer resolution."""

from __future__ import annotations

import dataclasses

import pytest

from vllm_ext.common.config import ConfigError, config_table, is_experimental
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
    assert cfg.forgetting == 0.999
    assert (cfg.max_wait_s, cfg.risk_k, cfg.prediction_timeout_s) == (30.0, 0.0, 1.0)
    assert (cfg.checkpoint_every, cfg.max_len, cfg.online_rls) == (64, 8192, True)


def test_env_and_block():
    env = {
        "VLLMEXT_LEAP_LAYER": "7",
        "VLLMEXT_LEAP_PRIOR": "fcfs",
        "VLLMEXT_LEAP_ONLINE_RLS": "false",
        "VLLMEXT_LEAP_FORGETTING": "0.99",
    }
    cfg = load_leap_config({"experimental": {"forgetting": 1}}, environ=env)
    assert cfg.layer == 7 and cfg.prior == "fcfs" and cfg.online_rls is False
    assert cfg.forgetting == 1.0


def test_unknown_key_is_an_error():
    with pytest.raises(ConfigError, match="'risk'"):
        load_leap_config({"risk": 1.0}, environ={})
    with pytest.raises(ConfigError, match="'risk'.*did you mean 'risk_k'"):
        load_leap_config({"experimental": {"risk": 1.0}}, environ={})


# what a deployment sets (review 2026-12 item 8), plus the keys that must match the
# calibrate CLI's options for the weights file (it records neither layer nor pooling)
PUBLIC = {
    "weights_path",
    "checkpoint_path",
    "max_wait_s",
    "preempt",
    "refine_weights_path",
    "layer",
    "pooling",
    "refine_every",
}


def test_public_keys_are_the_user_settings_and_the_rest_is_experimental():
    fields = dataclasses.fields(LeapConfig)
    assert {f.name for f in fields if not is_experimental(f)} == PUBLIC
    for f in fields:
        value = getattr(LeapConfig(), f.name)
        nested = {f.name: value} if f.name in PUBLIC else {"experimental": {f.name: value}}
        assert load_leap_config(nested, environ={}) == LeapConfig()
        wrong = {"experimental": {f.name: value}} if f.name in PUBLIC else {f.name: value}
        with pytest.raises(ConfigError, match=f"'{f.name}'"):
            load_leap_config(wrong, environ={})


def test_calibration_constants_are_not_serving_settings():
    names = {f.name for f in dataclasses.fields(LeapConfig)}
    assert not {"ridge_alpha", "rls_init_scale"} & names


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
        ("probe_slots", -1),
        ("refine_every", 0),
        ("refine_weights_path", ""),
        ("probe_slots", 1.5),
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
    tables = config_table(LeapConfig, "leap") + config_table(LeapConfig, "leap", experimental=True)
    for f in dataclasses.fields(LeapConfig):
        assert f.metadata["doc"] and tables.count(f"`VLLMEXT_LEAP_{f.name.upper()}`") == 1


def test_decode_probes_are_sent_only_when_something_reads_them():
    assert LeapConfig().decode_probe_every == 0
    assert LeapConfig(refine_weights_path="r.npz", refine_every=16).decode_probe_every == 16
    assert LeapConfig(return_probe=True).decode_probe_every == 32


def test_rls_runs_in_the_background_on_accelerators_unless_told():
    assert LeapConfig().rls_in_background(on_cpu=False)
    assert not LeapConfig().rls_in_background(on_cpu=True)
    assert LeapConfig(rls_thread=True).rls_in_background(on_cpu=True)
    assert not LeapConfig(rls_thread=False).rls_in_background(on_cpu=False)
    env = {"VLLMEXT_LEAP_RLS_THREAD": "true"}
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
