"""Converter checkpoints: weights, what they were fitted for, and their offline gate.

A checkpoint is a folder holding ``converters.safetensors`` and ``acct.json``
(format, the target's identity, source layers, sink tokens, training progress,
and the offline gate report once :mod:`vllm_ext.acct.quality` has measured
it). The special name ``identity`` means no converters: the target's own KV,
exact by construction (the plumbing mode).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_ext.acct.converter import Converters
from vllm_ext.acct.llama import LlamaShape, TorchLlama
from vllm_ext.acct.pipeline import AcctPipeline

FORMAT = 1
IDENTITY = "identity"
META_FILE = "acct.json"
WEIGHTS_FILE = "converters.safetensors"
_DIGEST_BYTES = 16 << 20


class CheckpointError(ValueError):
    """A checkpoint is missing, malformed, or was fitted for another model."""


def target_identity(model_dir: str | os.PathLike) -> dict[str, Any]:
    """Shape fields plus a digest of the weight files (size, first and last 16 MiB)."""
    folder = Path(model_dir)
    shape = LlamaShape.from_config(json.loads((folder / "config.json").read_text()))
    digest = hashlib.sha256()
    for file in sorted(folder.glob("*.safetensors")):
        size = file.stat().st_size
        digest.update(f"{file.name}:{size}".encode())
        with file.open("rb") as fh:
            digest.update(fh.read(_DIGEST_BYTES))
            fh.seek(max(size - _DIGEST_BYTES, 0))
            digest.update(fh.read(_DIGEST_BYTES))
    return {"shape": dataclasses.asdict(shape), "weights_sha256": digest.hexdigest()}


def identity_mismatch(expected: dict[str, Any], actual: dict[str, Any]) -> list[str]:
    """Names of the fields where a checkpoint's target and the served model differ."""
    diffs = [
        f"{key}: checkpoint {expected['shape'].get(key)!r}, model {value!r}"
        for key, value in actual["shape"].items()
        if expected["shape"].get(key) != value
    ]
    if expected.get("weights_sha256") != actual.get("weights_sha256"):
        diffs.append("weights_sha256 (same shape, different weights)")
    return diffs


@dataclass
class CheckpointMeta:
    target: dict[str, Any]
    source_layers: int
    sink_tokens: int
    trained: dict[str, Any] = field(default_factory=dict)
    gate: dict[str, Any] | None = None
    tail_tokens: int = 0  # set with the gate: the pipeline the gate measured
    format: int = FORMAT


def save(folder: str | os.PathLike, converters: Converters, meta: CheckpointMeta) -> None:
    """Write atomically: a reader never sees weights and metadata from two saves."""
    from safetensors.torch import save_file

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    tmp_weights, tmp_meta = out / f".{WEIGHTS_FILE}.tmp", out / f".{META_FILE}.tmp"
    save_file({k: v.contiguous() for k, v in converters.state_dict().items()}, tmp_weights)
    tmp_meta.write_text(json.dumps(dataclasses.asdict(meta), indent=2, sort_keys=True) + "\n")
    os.replace(tmp_weights, out / WEIGHTS_FILE)
    os.replace(tmp_meta, out / META_FILE)


def read_meta(folder: str | os.PathLike) -> CheckpointMeta:
    path = Path(folder) / META_FILE
    if not path.is_file():
        raise CheckpointError(f"{path} not found: not an ACCT checkpoint")
    data = json.loads(path.read_text())
    if data.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {data.get('format')!r}, expected {FORMAT}")
    names = {f.name for f in dataclasses.fields(CheckpointMeta)}
    return CheckpointMeta(**{k: v for k, v in data.items() if k in names})


def write_gate(folder: str | os.PathLike, gate: dict[str, Any], tail_tokens: int = 0) -> None:
    """Store a gate report and the tail it was measured with (the connector serves that)."""
    meta = read_meta(folder)
    meta.gate = gate
    meta.tail_tokens = tail_tokens
    path = Path(folder) / META_FILE
    tmp = path.with_name(f".{META_FILE}.tmp")
    tmp.write_text(json.dumps(dataclasses.asdict(meta), indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def load_converters(
    folder: str | os.PathLike, shape: LlamaShape
) -> tuple[Converters, CheckpointMeta]:
    from safetensors.torch import load_file

    meta = read_meta(folder)
    converters = Converters(shape, meta.source_layers)
    state = load_file(Path(folder) / WEIGHTS_FILE)
    missing, unexpected = converters.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise CheckpointError(f"{folder}: missing {missing}, unexpected {unexpected}")
    return converters, meta


def load_pipeline(
    checkpoint: str,
    model_dir: str | os.PathLike,
    target: TorchLlama,
    tail_tokens: int | None = None,
) -> tuple[AcctPipeline, CheckpointMeta | None]:
    """The pipeline a checkpoint describes, after checking it was fitted for ``model_dir``.

    ``tail_tokens`` overrides the checkpoint's (evaluation of other settings).
    """
    if checkpoint == IDENTITY:
        return AcctPipeline(target, None), None
    meta = read_meta(checkpoint)
    diffs = identity_mismatch(meta.target, target_identity(model_dir))
    if diffs:
        raise CheckpointError(
            f"ACCT checkpoint {checkpoint} was fitted for another model: " + "; ".join(diffs)
        )
    converters, meta = load_converters(checkpoint, target.shape)
    converters = converters.to(target.dtype).requires_grad_(False)
    tail = meta.tail_tokens if tail_tokens is None else tail_tokens
    return AcctPipeline(target, converters, meta.sink_tokens, tail), meta
