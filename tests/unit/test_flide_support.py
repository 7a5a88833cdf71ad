"""Flide refuses, by name, every architecture it cannot pack exactly."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from vllm_ext.flide.forward import (  # noqa: E402
    SUPPORTED_ARCHITECTURES,
    UNPACKABLE,
    UnsupportedModelError,
    check_supported,
)


@pytest.mark.parametrize("architecture", [*UNPACKABLE, "MambaForCausalLM"])
def test_unsupported_architectures_are_refused_by_name(architecture):
    with pytest.raises(UnsupportedModelError) as info:
        check_supported(torch.nn.Module(), architecture)
    message = str(info.value)
    assert f"cannot pack {architecture}" in message
    assert all(name in message for name in SUPPORTED_ARCHITECTURES)


def test_every_gated_deltanet_model_of_vllm_is_supported_or_refused():
    import pathlib

    import vllm

    models = pathlib.Path(vllm.__file__).parent / "model_executor" / "models"
    users = set()
    for path in models.glob("*.py"):
        text = path.read_text()
        if "GatedDeltaNetAttention" in text:
            users |= {line.split("class ")[1].split("(")[0] for line in text.splitlines()
                      if line.startswith("class ") and "For" in line}  # fmt: skip
    assert users, "no Gated DeltaNet model found in vLLM"
    unknown = users - set(SUPPORTED_ARCHITECTURES) - set(UNPACKABLE)
    registered = {u for u in unknown if not u.endswith(("Base", "MTP"))}
    assert not registered, f"Gated DeltaNet models Flide neither packs nor refuses: {registered}"
