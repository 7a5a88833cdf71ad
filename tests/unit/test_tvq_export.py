"""TVQ exporter round trip and format/config validation on the tiny Llama asset."""

from __future__ import annotations

import json

import pytest
import torch

from vllm_ext.assets import model_path
from vllm_ext.common.config import ConfigError
from vllm_ext.tvq.config import tvq_config
from vllm_ext.tvq.export import export, load_reference
from vllm_ext.tvq.format import QuantFormat
from vllm_ext.tvq.qat import VQLinear, quantize_mlps

torch.set_num_threads(1)


@pytest.mark.parametrize("dim,k", [(4, 16), (2, 300)])
def test_export_round_trip(tmp_path, dim, k):
    from transformers import AutoModelForCausalLM

    base = model_path("tiny-llama")
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    vqs = quantize_mlps(model, dim, k, kmeans_iters=2)
    assert len(vqs) == 3 * model.config.num_hidden_layers
    fmt = QuantFormat(dim, k)
    out = export(model, base, tmp_path / "ckpt", fmt)
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "tvq" and QuantFormat.from_dict(cfg) == fmt
    ref = load_reference(out)
    ids = torch.randint(0, 100, (1, 12))
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, VQLinear):
                # the checkpoint stores codebooks and scales in bf16
                m.codebook.data = m.codebook.data.bfloat16().float()
                m.scale.data = m.scale.data.bfloat16().float()
        expected = model.to(torch.bfloat16).float()(ids).logits
        torch.testing.assert_close(ref(ids).logits, expected, rtol=2e-2, atol=2e-2)
    from safetensors.torch import load_file

    codes = load_file(str(out / "model.safetensors"))["model.layers.0.mlp.up_proj.codes"]
    assert codes.dtype == (torch.uint8 if k <= 256 else torch.int32)


def test_format_and_config_reject_bad_values():
    with pytest.raises(ValueError, match="vec_dim"):
        QuantFormat.from_dict({"quant_method": "tvq"})
    with pytest.raises(ConfigError, match="max_kernel_tokens"):
        tvq_config({"max_kernel_tokens": -1})
    assert tvq_config({}, environ={"VLLMEXT_TVQ_MAX_KERNEL_TOKENS": "0"}).max_kernel_tokens == 0


def test_serve_validates_the_tvq_block_before_vllm_starts():
    from vllm_ext.common.systems import validate_additional_config

    with pytest.raises(ConfigError, match="max_kernel_tokens"):
        validate_additional_config({"tvq": {"max_kernel_tokens": -1}}, environ={})
    with pytest.raises(ConfigError, match="max_kernel_token"):
        validate_additional_config({"tvq": {"max_kernel_token": 4}}, environ={})
    configs = validate_additional_config({"tvq": {"max_kernel_tokens": 3}}, environ={})
    assert configs["tvq"].max_kernel_tokens == 3


def test_quantization_config_reads_the_block_of_the_current_vllm_config(monkeypatch):
    from vllm.config import VllmConfig, set_current_vllm_config

    from vllm_ext.tvq.linear_method import TvqQuantizationConfig

    monkeypatch.setenv("VLLMEXT_TVQ_MAX_KERNEL_TOKENS", "5")
    fmt = {"quant_method": "tvq", "vec_dim": 4, "num_codewords": 16}
    # outside an engine: the environment; inside the loader: additional_config beats it
    assert TvqQuantizationConfig.from_config(fmt).runtime.max_kernel_tokens == 5
    vllm_config = VllmConfig(additional_config={"tvq": {"max_kernel_tokens": 2}})
    with set_current_vllm_config(vllm_config):
        assert TvqQuantizationConfig.from_config(fmt).runtime.max_kernel_tokens == 2
