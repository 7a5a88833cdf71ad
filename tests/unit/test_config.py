"""load_config: block > VLLMEXT_<SYSTEM>_<FIELD> env > defaults; experimental keys nest.

Unknown keys, keys on the wrong side of "experimental" and the retired
VLLM_EXT_ prefix are errors that name the key and the valid ones.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import Literal

import pytest

from vllm_ext.common.config import (
    ConfigError,
    config_block,
    config_table,
    flatten_block,
    load_config,
    option,
)


@dataclass(frozen=True)
class DemoConfig:
    layer: int = option(12, doc="decoder layer to probe")
    forgetting: float = option(0.99, experimental=True, doc="RLS forgetting factor")
    pooling: Literal["last", "mean"] = option("last", doc="how to pool the prompt")
    enabled: bool = option(False, doc="turn the system on")
    path: str | None = option(None, doc="weights file")
    tiers: tuple[str, ...] = option(("host", "ssd"), experimental=True, doc="storage tiers")

    def __post_init__(self):
        if not 0 < self.forgetting <= 1:
            raise ConfigError(f"forgetting must be in (0, 1], got {self.forgetting}")


@dataclass(frozen=True)
class PublicOnly:
    size: int = option(3, doc="a size")


def test_defaults_when_nothing_given():
    assert load_config(DemoConfig, "demo", environ={}) == DemoConfig()
    assert load_config(DemoConfig, "demo", {"experimental": {}}, environ={}) == DemoConfig()


def test_block_beats_env_beats_default():
    env = {"VLLMEXT_DEMO_LAYER": "5", "VLLMEXT_DEMO_FORGETTING": "0.9"}
    cfg = load_config(DemoConfig, "demo", {"layer": 7}, environ=env)
    assert cfg.layer == 7 and cfg.forgetting == 0.9
    cfg = load_config(DemoConfig, "demo", {"experimental": {"forgetting": 0.5}}, environ=env)
    assert cfg.layer == 5 and cfg.forgetting == 0.5


def test_env_text_is_parsed_by_field_type():
    env = {
        "VLLMEXT_DEMO_ENABLED": "true",
        "VLLMEXT_DEMO_TIERS": "host,ssd,remote",
        "VLLMEXT_DEMO_PATH": "123",
        "VLLMEXT_DEMO_POOLING": "mean",
    }
    cfg = load_config(DemoConfig, "demo", environ=env)
    assert cfg.enabled is True
    assert cfg.tiers == ("host", "ssd", "remote")
    assert cfg.path == "123"
    assert cfg.pooling == "mean"


def test_unknown_key_names_key_close_match_and_valid_ones():
    with pytest.raises(ConfigError) as err:
        load_config(DemoConfig, "demo", {"layr": 3}, environ={})
    message = str(err.value)
    assert "'layr'" in message and 'additional_config["demo"]' in message
    assert "did you mean 'layer'?" in message
    assert "valid: enabled, layer, path, pooling, experimental" in message
    assert "\n" not in message


def test_experimental_key_at_the_top_says_where_it_belongs():
    with pytest.raises(ConfigError) as err:
        load_config(DemoConfig, "demo", {"forgetting": 0.5}, environ={})
    assert "'forgetting'" in str(err.value) and 'inside additional_config["demo"]' in str(err.value)
    assert '["experimental"]' in str(err.value)


def test_public_key_inside_experimental_says_where_it_belongs():
    with pytest.raises(ConfigError, match=r"'layer' .* is a public key"):
        load_config(DemoConfig, "demo", {"experimental": {"layer": 1}}, environ={})


def test_unknown_experimental_key_lists_the_experimental_ones():
    with pytest.raises(ConfigError) as err:
        load_config(DemoConfig, "demo", {"experimental": {"tier": ["x"]}}, environ={})
    assert "unknown experimental key 'tier'" in str(err.value)
    assert "did you mean 'tiers'?" in str(err.value)
    assert str(err.value).endswith("valid: forgetting, tiers")


def test_a_system_without_experimental_fields_has_no_experimental_block():
    with pytest.raises(ConfigError) as err:
        load_config(PublicOnly, "p", {"experimental": {"size": 1}}, environ={})
    assert "is a public key" in str(err.value)
    with pytest.raises(ConfigError, match=r"valid: size$"):
        load_config(PublicOnly, "p", {"sise": 1}, environ={})


@pytest.mark.parametrize("block", [[1], "x", {"experimental": [1]}])
def test_blocks_must_be_objects(block):
    with pytest.raises(ConfigError, match="must be a JSON object"):
        load_config(DemoConfig, "demo", block, environ={})


def test_unknown_env_var_is_an_error():
    with pytest.raises(ConfigError, match="VLLMEXT_DEMO_LAYR.*did you mean 'VLLMEXT_DEMO_LAYER'"):
        load_config(DemoConfig, "demo", environ={"VLLMEXT_DEMO_LAYR": "3"})


def test_old_prefix_is_an_error_naming_the_new_name():
    with pytest.raises(ConfigError) as err:
        load_config(DemoConfig, "demo", environ={"VLLM_EXT_DEMO_LAYER": "3"})
    assert "VLLM_EXT_DEMO_LAYER -> VLLMEXT_DEMO_LAYER" in str(err.value)


def test_other_systems_env_vars_are_ignored():
    env = {"VLLMEXT_OTHER_X": "1", "VLLM_EXT_OTHER_X": "1"}
    assert load_config(DemoConfig, "demo", environ=env) == DemoConfig()


@pytest.mark.parametrize(
    "mapping, needle",
    [
        ({"layer": "twelve"}, "DemoConfig.layer must be int"),
        ({"layer": True}, "DemoConfig.layer must be int"),
        ({"pooling": "max"}, "must be one of ['last', 'mean']"),
        ({"enabled": "maybe"}, "must be a boolean"),
        ({"experimental": {"tiers": 3}}, "must be a list"),
        ({"experimental": {"forgetting": 1.5}}, "forgetting must be in (0, 1]"),
    ],
)
def test_bad_values_raise_named_errors(mapping, needle):
    with pytest.raises(ConfigError) as err:
        load_config(DemoConfig, "demo", mapping, environ={})
    assert needle in str(err.value)


def test_int_accepted_for_float_and_result_is_frozen():
    cfg = load_config(DemoConfig, "demo", {"experimental": {"forgetting": 1}}, environ={})
    assert cfg.forgetting == 1.0 and isinstance(cfg.forgetting, float)
    with pytest.raises(AttributeError):
        cfg.layer = 3


def test_non_frozen_dataclass_rejected():
    @dataclass
    class Loose:
        a: int = 1

    with pytest.raises(TypeError, match="frozen"):
        load_config(Loose, "loose", environ={})


def test_config_block_and_flatten_block_are_inverse_on_random_settings():
    rng = random.Random(0)
    choices = {
        "layer": lambda: rng.randrange(40),
        "forgetting": lambda: rng.uniform(0.5, 1.0),
        "pooling": lambda: rng.choice(["last", "mean"]),
        "enabled": lambda: rng.random() < 0.5,
        "path": lambda: rng.choice([None, "w.npz"]),
        "tiers": lambda: tuple(rng.sample(["host", "ssd", "remote"], rng.randrange(4))),
    }
    for _ in range(50):
        values = {k: make() for k, make in choices.items() if rng.random() < 0.6}
        block = config_block(DemoConfig, values)
        assert set(block.get("experimental", {})) == {"forgetting", "tiers"} & set(values)
        assert flatten_block(DemoConfig, "demo", block) == values
        loaded = load_config(DemoConfig, "demo", block, environ={})
        assert loaded == dataclasses.replace(DemoConfig(), **values)
    with pytest.raises(ConfigError, match="unknown field 'layr' of DemoConfig"):
        config_block(DemoConfig, {"layr": 1})


def test_config_tables_split_public_and_experimental_fields():
    table = config_table(DemoConfig, "demo")
    assert "| `layer` | `int` | `12` | `VLLMEXT_DEMO_LAYER` | decoder layer to probe |" in table
    assert table.count("\n") == 2 + 3
    # choices shown; "|" escaped so GitHub does not split the cell
    assert "| `pooling` | `Literal['last', 'mean']` |" in table
    assert "| `path` | `str \\| None` | `None` |" in table
    hidden = config_table(DemoConfig, "demo", experimental=True)
    assert hidden.count("\n") == 2 + 1
    assert "| `forgetting` | `float` | `0.99` | `VLLMEXT_DEMO_FORGETTING` |" in hidden
    assert "`tiers`" in hidden and "`layer`" not in hidden
