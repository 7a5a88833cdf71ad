"""Cluster and model descriptions (YAML or dicts), checked field by field.

A cluster is a list of device groups (one GPU type each) plus the link
bandwidth between vendors; a model is a dense decoder (Llama-style, SwiGLU).
Every error names the field, e.g. ``cluster.groups[1].mem_gib must be > 0``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

GIB = 1 << 30


class SpecError(ValueError):
    """A cluster/model description that cannot be planned; the message names the field."""


@dataclasses.dataclass(frozen=True)
class DeviceGroup:
    """``count`` GPUs of one type, ``gpus_per_node`` to a node."""

    name: str
    vendor: str
    type: str
    count: int
    gpus_per_node: int
    mem_gib: float
    bf16_tflops: float
    mfu: float
    hbm_gbps: float
    intra_gbps: float
    inter_gbps: float
    workspace_gib: float = 1.5  # CUDA/ROCm context, allocator slack, library handles

    @property
    def mem_bytes(self) -> float:
        return self.mem_gib * GIB


@dataclasses.dataclass(frozen=True)
class Cluster:
    groups: tuple[DeviceGroup, ...]
    cross_vendor_gbps: float

    def link_gbps(self, a: DeviceGroup, b: DeviceGroup) -> float:
        """Bandwidth of a pipeline hop from group ``a`` to group ``b``."""
        if a.vendor != b.vendor:
            return self.cross_vendor_gbps
        return min(a.inter_gbps, b.inter_gbps)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    name: str
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int
    dtype_bytes: int = 2
    optimizer: str = "adam"
    zero_stage: int = 1

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def layer_params(self) -> int:
        """Parameters of one transformer layer: q/o, k/v (GQA), SwiGLU, two norms."""
        h, kv = self.hidden, self.kv_heads * self.head_dim
        return 2 * h * h + 2 * h * kv + 3 * h * self.ffn + 2 * h

    @property
    def embed_params(self) -> int:
        return self.vocab * self.hidden


def _field(data: Mapping[str, Any], key: str, where: str, kind: type, positive: bool = True):
    if key not in data:
        raise SpecError(f"{where}.{key} is missing")
    value = data[key]
    if kind is str:
        if not isinstance(value, str) or not value:
            raise SpecError(f"{where}.{key} must be a non-empty string, got {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SpecError(f"{where}.{key} must be a number, got {value!r}")
    if kind is int and value != int(value):
        raise SpecError(f"{where}.{key} must be an integer, got {value!r}")
    if positive and value <= 0:
        raise SpecError(f"{where}.{key} must be > 0, got {value!r}")
    return kind(value)


def _unknown(data: Mapping[str, Any], allowed: set[str], where: str) -> None:
    extra = sorted(set(data) - allowed)
    if extra:
        raise SpecError(f"{where}: unknown field(s) {extra}; valid: {sorted(allowed)}")


def _mapping(data: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(data, Mapping):
        raise SpecError(f"{where} must be a mapping, got {type(data).__name__}")
    return data


_GROUP_NUMBERS = {
    "count": int,
    "gpus_per_node": int,
    "mem_gib": float,
    "bf16_tflops": float,
    "mfu": float,
    "hbm_gbps": float,
    "intra_gbps": float,
    "inter_gbps": float,
}


def cluster_from_dict(data: Any) -> Cluster:
    data = _mapping(data, "cluster")
    _unknown(data, {"groups", "cross_vendor_gbps", "source"}, "cluster")
    groups = data.get("groups")
    if not isinstance(groups, list) or not groups:
        raise SpecError("cluster.groups must be a non-empty list of device groups")
    out = []
    for i, raw in enumerate(groups):
        where = f"cluster.groups[{i}]"
        raw = _mapping(raw, where)
        _unknown(raw, {"name", "vendor", "type", "workspace_gib", "source", *_GROUP_NUMBERS}, where)
        values = {k: _field(raw, k, where, t) for k, t in _GROUP_NUMBERS.items()}
        if values["mfu"] > 1:
            raise SpecError(f"{where}.mfu must be a fraction in (0, 1], got {values['mfu']!r}")
        if values["count"] % values["gpus_per_node"]:
            raise SpecError(
                f"{where}.count ({values['count']}) is not a multiple of "
                f"gpus_per_node ({values['gpus_per_node']})"
            )
        group = DeviceGroup(
            name=str(raw.get("name", f"{raw.get('type', 'group')}-{i}")),
            vendor=_field(raw, "vendor", where, str),
            type=_field(raw, "type", where, str),
            workspace_gib=_field(raw, "workspace_gib", where, float, positive=False)
            if "workspace_gib" in raw
            else 1.5,
            **values,
        )
        out.append(group)
    names = [g.name for g in out]
    if len(set(names)) != len(names):
        raise SpecError(f"cluster.groups: duplicate names {names}")
    cross = _field(data, "cross_vendor_gbps", "cluster", float)
    return Cluster(tuple(out), cross)


_MODEL_INTS = ("layers", "hidden", "ffn", "heads", "kv_heads", "vocab")


def model_from_dict(data: Any) -> ModelSpec:
    data = _mapping(data, "model")
    allowed = {"name", "dtype_bytes", "optimizer", "zero_stage", "source", *_MODEL_INTS}
    _unknown(data, allowed, "model")
    values = {k: _field(data, k, "model", int) for k in _MODEL_INTS}
    if values["hidden"] % values["heads"]:
        raise SpecError(f"model.hidden ({values['hidden']}) is not a multiple of model.heads")
    if values["heads"] % values["kv_heads"]:
        raise SpecError(f"model.heads ({values['heads']}) is not a multiple of model.kv_heads")
    optimizer = data.get("optimizer", "adam")
    if optimizer not in ("adam", "sgd"):
        raise SpecError(f"model.optimizer must be 'adam' or 'sgd', got {optimizer!r}")
    zero = data.get("zero_stage", 1)
    if zero not in (0, 1, 2, 3):
        raise SpecError(f"model.zero_stage must be 0, 1, 2 or 3, got {zero!r}")
    dtype_bytes = data.get("dtype_bytes", 2)
    if dtype_bytes not in (2, 4):
        raise SpecError(f"model.dtype_bytes must be 2 (bf16) or 4 (fp32), got {dtype_bytes!r}")
    return ModelSpec(
        name=str(data.get("name", "model")),
        optimizer=optimizer,
        zero_stage=zero,
        dtype_bytes=dtype_bytes,
        **values,
    )


def load_yaml(path: str | Path, what: str) -> Any:
    import yaml

    path = Path(path)
    if not path.is_file():
        raise SpecError(f"{what} file {str(path)!r} does not exist")
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise SpecError(f"{what} file {str(path)!r} is not valid YAML: {exc}") from None


def load_cluster(path: str | Path) -> Cluster:
    return cluster_from_dict(load_yaml(path, "cluster"))


def load_model(path: str | Path) -> ModelSpec:
    return model_from_dict(load_yaml(path, "model"))
