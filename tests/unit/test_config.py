"""load_config: mapping > VLLM_EXT_<SYSTEM>_<FIELD> env > defaults; unknown keys are errors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import pytest

from vllm_ext.common.config import ConfigError, config_table, load_config, option


@dataclass(frozen=True)
class DemoConfig:
    layer: int = option(12, doc="decoder layer to probe")
    forgetting: float = option(0.99, doc="RLS forgetting factor")
    pooling: Literal["last", "mean"] = option("last", doc="how to pool the prompt")
    enabled: bool = option(False, doc="turn the system on")
    path: str | None = option(None, doc="weights file")
    tiers: tuple[str, ...] = option(("host", "ssd"), doc="storage tiers")

    def __post_init__(self):
        if not 0 < self.forgetting <= 1:
            raise ConfigError(f"forgetting must be in (0, 1], got {self.forgetting}")


def test_defaults_when_nothing_given():
    assert load_config(DemoConfig, "demo", environ={}) == DemoConfig()


def test_mapping_beats_env_beats_default():
    env = {"VLLM_EXT_DEMO_LAYER": "5", "VLLM_EXT_DEMO_FORGETTING": "0.9"}
    cfg = load_config(DemoConfig, "demo", {"layer": 7}, environ=env)
    assert cfg.layer == 7 and cfg.forgetting == 0.9


def test_env_text_is_parsed_by_field_type():
    env = {
        "VLLM_EXT_DEMO_ENABLED": "true",
        "VLLM_EXT_DEMO_TIERS": "host,ssd,remote",
        "VLLM_EXT_DEMO_PATH": "123",
        "VLLM_EXT_DEMO_POOLING": "mean",
    }
    cfg = load_config(DemoConfig, "demo", environ=env)
    assert cfg.enabled is True
    assert cfg.tiers == ("host", "ssd", "remote")
    assert cfg.path == "123"
    assert cfg.pooling == "mean"


def test_unknown_key_names_key_and_allowed_ones():
    with pytest.raises(ConfigError) as err:
        load_config(DemoConfig, "demo", {"layr": 3}, environ={})
    message = str(err.value)
    assert "'layr'" in message and "DemoConfig" in message
    assert "layer" in message and "forgetting" in message


def test_unknown_env_var_is_an_error():
    with pytest.raises(ConfigError, match="VLLM_EXT_DEMO_LAYR"):
        load_config(DemoConfig, "demo", environ={"VLLM_EXT_DEMO_LAYR": "3"})


def test_other_systems_env_vars_are_ignored():
    cfg = load_config(DemoConfig, "demo", environ={"VLLM_EXT_OTHER_X": "1"})
    assert cfg == DemoConfig()


@pytest.mark.parametrize(
    "mapping, needle",
    [
        ({"layer": "twelve"}, "DemoConfig.layer must be int"),
        ({"layer": True}, "DemoConfig.layer must be int"),
        ({"pooling": "max"}, "must be one of ['last', 'mean']"),
        ({"enabled": "maybe"}, "must be a boolean"),
        ({"tiers": 3}, "must be a list"),
        ({"forgetting": 1.5}, "forgetting must be in (0, 1]"),
    ],
)
def test_bad_values_raise_named_errors(mapping, needle):
    with pytest.raises(ConfigError) as err:
        load_config(DemoConfig, "demo", mapping, environ={})
    assert needle in str(err.value)


def test_int_accepted_for_float_and_result_is_frozen():
    cfg = load_config(DemoConfig, "demo", {"forgetting": 1}, environ={})
    assert cfg.forgetting == 1.0 and isinstance(cfg.forgetting, float)
    with pytest.raises(AttributeError):
        cfg.layer = 3


def test_non_frozen_dataclass_rejected():
    @dataclass
    class Loose:
        a: int = 1

    with pytest.raises(TypeError, match="frozen"):
        load_config(Loose, "loose", environ={})


def test_config_table_lists_every_field_with_env_var_and_doc():
    table = config_table(DemoConfig, "demo")
    assert "| `layer` | `int` | `12` | `VLLM_EXT_DEMO_LAYER` | decoder layer to probe |" in table
    assert table.count("\n") == 2 + 5
    # choices shown; "|" escaped so GitHub does not split the cell
    assert "| `pooling` | `Literal['last', 'mean']` |" in table
    assert "| `path` | `str \\| None` | `None` |" in table
