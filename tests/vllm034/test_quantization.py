"""TVQ and ETAPS quantization methods inside vLLM 0.34's own linear layers, registry and configs.

Each method is looked up through 0.34's registry, built by 0.34's
``MergedColumnParallelLinear`` / ``QKVParallelLinear`` / ``RowParallelLinear``
(a world of one, gloo), loaded shard by shard through the weight loaders 0.34
gives its parameters (as a model's ``load_weights`` calls them), and run by the
layer's ``forward``. Outputs are compared with a plain dense matmul of the
weight the checkpoint tensors stand for, on random shapes, both sides of each
method's kernel/dense switch (the compiled CPU kernels where a compiler is
present, their torch references otherwise). The runtime block comes from a
``--additional-config`` dict that goes through 0.34's ``EngineArgs`` and
``VllmConfig``. Last, exported checkpoints go through 0.34's own loader into
its ``LlamaForCausalLM`` and its layers are compared with the dense reference.
"""

from __future__ import annotations

import contextlib
import json

import model034_helpers
import pytest
import torch

from vllm_ext.etaps.sparse_format import SparseFormat, compact
from vllm_ext.tvq.format import QuantFormat

# error per unit of sum |x| |w| (the scale of a matmul's rounding error); bf16 rounds the
# weight, the output and the matmul's partial sums
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
GATE_UP = "model.layers.0.mlp.gate_up_proj"
DOWN = "model.layers.0.mlp.down_proj"
QKV = "model.layers.0.self_attn.qkv_proj"
O_PROJ = "model.layers.0.self_attn.o_proj"


@pytest.fixture(scope="module")
def world_of_one():
    with model034_helpers.world_of_one():
        yield


@contextlib.contextmanager
def serving(additional: dict):
    """A ``VllmConfig`` carrying ``additional`` is current (the loader's context)."""
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig(additional_config=additional)) as config:
        yield config


def _registered(method: str):
    from vllm.model_executor.layers.quantization import get_quantization_config

    from vllm_ext.etaps import plugin as etaps_plugin
    from vllm_ext.tvq import plugin as tvq_plugin

    # twice: vLLM loads general plugins in several places of one process
    for _ in range(2):
        tvq_plugin.register()
        etaps_plugin.register()
    return get_quantization_config(method)


def _check(got, x: torch.Tensor, weight: torch.Tensor, bias=None) -> None:
    """``got`` (a layer's output) against ``x @ weight.T + bias`` in fp32."""
    want = x.float() @ weight.T + (0 if bias is None else bias.float())
    scale = x.float().abs() @ weight.abs().T + 1
    err = ((got.float() - want) / scale).abs().max().item()
    assert err < TOLERANCE[x.dtype], f"worst error {err} per unit of sum |x| |w|"


def test_both_methods_come_from_vllms_registry():
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS

    from vllm_ext.etaps.linear_method import EtapsQuantizationConfig
    from vllm_ext.tvq.linear_method import TvqQuantizationConfig

    assert _registered("tvq") is TvqQuantizationConfig
    assert _registered("etaps") is EtapsQuantizationConfig
    assert QUANTIZATION_METHODS.count("tvq") == QUANTIZATION_METHODS.count("etaps") == 1


def _tvq_shard(gen, rows: int, groups: int, fmt: QuantFormat, dtype: torch.dtype):
    """Checkpoint tensors of one shard and the dense fp32 weight they stand for."""
    codes = torch.randint(0, fmt.num_codewords, (rows, groups), generator=gen)
    codebook = torch.randn(fmt.num_codewords, fmt.vec_dim, generator=gen).to(dtype)
    scale = (torch.rand(rows, 1, generator=gen) + 0.5).to(dtype)
    dense = codebook.float()[codes].reshape(rows, groups * fmt.vec_dim) * scale.float()
    return {"codes": codes.to(fmt.code_dtype), "codebook": codebook, "scale": scale}, dense


def _load(layer, tensors: dict[str, torch.Tensor], shard_id=None) -> None:
    """As a model's ``load_weights``: each tensor through its parameter's own loader."""
    params = dict(layer.named_parameters())
    for name, tensor in tensors.items():
        param = params[name]
        if shard_id is None:
            param.weight_loader(param, tensor)
        else:
            param.weight_loader(param, tensor, shard_id)


@pytest.mark.parametrize("seed", range(6))
def test_tvq_layers_equal_the_dense_weight_they_encode(world_of_one, seed):
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear, RowParallelLinear

    gen = torch.Generator().manual_seed(seed)
    dtype = (torch.float32, torch.bfloat16)[seed % 2]
    dim = int(torch.randint(1, 9, (1,), generator=gen))
    k = (16, 256, 300)[seed % 3]  # uint8 codes up to 256 codewords, int32 beyond
    fmt = QuantFormat(dim, k)
    hidden = dim * int(torch.randint(2, 20, (1,), generator=gen))
    inter = dim * int(torch.randint(2, 20, (1,), generator=gen))
    kernel_tokens = (0, 8)[seed % 2 == 0]
    config = _registered("tvq").from_config(fmt.to_dict())
    with serving({"tvq": {"max_kernel_tokens": kernel_tokens}}):
        gate_up = MergedColumnParallelLinear(hidden, [inter, inter], bias=False,
                                             quant_config=config, params_dtype=dtype,
                                             prefix=GATE_UP)  # fmt: skip
        down = RowParallelLinear(inter, hidden, bias=True, quant_config=config,
                                 params_dtype=dtype, prefix=DOWN)  # fmt: skip
    assert type(gate_up.quant_method).__name__ == "TvqLinearMethod"
    assert gate_up.quant_method.max_kernel_tokens == kernel_tokens
    dense_shards = []
    for shard in (0, 1):
        tensors, dense = _tvq_shard(gen, inter, hidden // dim, fmt, dtype)
        _load(gate_up, tensors, shard)
        dense_shards.append(dense)
    tensors, dense_down = _tvq_shard(gen, hidden, inter // dim, fmt, dtype)
    bias = torch.randn(hidden, generator=gen).to(dtype)
    _load(down, {**tensors, "bias": bias})
    for layer in (gate_up, down):
        layer.quant_method.process_weights_after_loading(layer)
    w_gate_up = torch.cat(dense_shards)
    for tokens in (1, 3, 8, 9, 40):
        x = torch.randn(tokens, hidden, generator=gen).to(dtype)
        y, _ = gate_up(x)
        _check(y, x, w_gate_up)
        h = torch.randn(tokens, inter, generator=gen).to(dtype)
        out, _ = down(h)
        _check(out, h, dense_down, bias)


def _pruned(gen, rows: int, cols: int, nnz: int) -> torch.Tensor:
    """A random ``[rows, cols]`` weight keeping ``nnz`` random columns per row (bf16 values)."""
    weight = torch.zeros(rows, cols)
    for r in range(rows):
        keep = torch.randperm(cols, generator=gen)[:nnz]
        weight[r, keep] = torch.randn(nnz, generator=gen)
    return weight.bfloat16().float()


@pytest.mark.parametrize("seed", range(6))
def test_etaps_layers_equal_the_pruned_dense_weight(world_of_one, seed):
    from vllm.model_executor.layers.linear import QKVParallelLinear, RowParallelLinear

    gen = torch.Generator().manual_seed(seed)
    dtype = (torch.float32, torch.bfloat16)[seed % 2]
    # below and above min_kernel_sparsity (0.7): densified at load vs the sparse kernel
    sparsity = (0.5, 0.9, 0.75)[seed % 3]
    fmt = SparseFormat(sparsity)
    head = int(torch.randint(2, 9, (1,), generator=gen))
    heads, kv_heads = 4, (1, 2, 4)[seed % 3]
    hidden = int(torch.randint(8, 70, (1,), generator=gen))
    config = _registered("etaps").from_config(fmt.to_dict())
    with serving({"etaps": {"max_sparse_tokens": 4, "min_kernel_sparsity": 0.7}}):
        qkv = QKVParallelLinear(hidden, head, heads, kv_heads, bias=True, quant_config=config,
                                params_dtype=dtype, prefix=QKV)  # fmt: skip
        o_proj = RowParallelLinear(heads * head, hidden, bias=False, quant_config=config,
                                   params_dtype=dtype, prefix=O_PROJ)  # fmt: skip
    assert type(qkv.quant_method).__name__ == "EtapsSparseLinearMethod"
    assert qkv.quant_method.runtime.max_sparse_tokens == 4
    dense = {}
    for shard, rows in (("q", heads * head), ("k", kv_heads * head), ("v", kv_heads * head)):
        dense[shard] = _pruned(gen, rows, hidden, fmt.nnz(hidden))
        values, indices = compact(dense[shard], fmt.nnz(hidden))
        _load(qkv, {"values": values, "indices": indices}, shard)
    bias = {s: torch.randn(w.shape[0], generator=gen).to(dtype) for s, w in dense.items()}
    for shard, b in bias.items():
        _load(qkv, {"bias": b}, shard)
    w_o = _pruned(gen, hidden, heads * head, fmt.nnz(heads * head))
    values, indices = compact(w_o, fmt.nnz(heads * head))
    _load(o_proj, {"values": values, "indices": indices})
    for layer in (qkv, o_proj):
        layer.quant_method.process_weights_after_loading(layer)
    assert (qkv.dense_weight is None) == (sparsity >= 0.7)
    w_qkv = torch.cat([dense[s] for s in "qkv"])
    b_qkv = torch.cat([bias[s] for s in "qkv"])
    for tokens in (1, 4, 5, 33):
        x = torch.randn(tokens, hidden, generator=gen).to(dtype)
        y, _ = qkv(x)
        _check(y, x, w_qkv, b_qkv)
        h = torch.randn(tokens, heads * head, generator=gen).to(dtype)
        out, _ = o_proj(h)
        _check(out, h, w_o)


def test_uncovered_layers_stay_unquantized(world_of_one):
    from vllm.model_executor.layers.linear import ReplicatedLinear, UnquantizedLinearMethod

    for method, fmt in (("tvq", QuantFormat(4, 16)), ("etaps", SparseFormat(0.9))):
        config = _registered(method).from_config(fmt.to_dict())
        with serving({}):
            head = ReplicatedLinear(16, 8, bias=False, quant_config=config, prefix="lm_head")
        assert isinstance(head.quant_method, UnquantizedLinearMethod)


@pytest.fixture
def checkpoint_dir(tmp_path):
    """The tiny Llama asset's files with a ``quantization_config`` added to its config.json."""
    from vllm_ext.assets import model_path

    base = model_path("tiny-llama")
    for item in base.iterdir():
        if item.name != "config.json":
            (tmp_path / item.name).symlink_to(item)
    config = json.loads((base / "config.json").read_text())

    def with_format(fmt) -> str:
        (tmp_path / "config.json").write_text(
            json.dumps({**config, "quantization_config": fmt.to_dict()})
        )
        return str(tmp_path)

    return with_format


@pytest.mark.parametrize(
    ("method", "fmt"),
    [("tvq", QuantFormat(4, 300, ("mlp.down_proj",))), ("etaps", SparseFormat(0.8))],
)
def test_vllm_reads_the_method_from_the_checkpoint(checkpoint_dir, method, fmt):
    """0.34's ``ModelConfig`` picks the method from config.json; its loader builds our config."""
    from vllm.config import LoadConfig, ModelConfig
    from vllm.model_executor.model_loader.weight_utils import get_quant_config

    _registered(method)
    model_config = ModelConfig(checkpoint_dir(fmt), dtype="bfloat16")
    assert model_config.quantization == method
    quant_config = get_quant_config(model_config, LoadConfig())
    assert quant_config.get_name() == method
    assert quant_config.fmt == fmt


ADDITIONAL = {
    "tvq": {"max_kernel_tokens": 3},
    "etaps": {"max_sparse_tokens": 2, "min_kernel_sparsity": 0.5},
    "flide": {},
    "leap": {"experimental": {"forgetting": 0.99}},
}


def test_additional_config_dict_reaches_the_methods_through_vllm_config():
    """``--additional-config`` parsed by 0.34's CLI: the dict stays a dict in ``VllmConfig``
    (with the keys vLLM itself adds to it), feeds the compile hash whole, and each system
    reads its block from it."""
    from vllm.config import set_current_vllm_config
    from vllm.config.utils import hash_factors
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from vllm_ext.common.systems import config_from_vllm, validate_additional_config
    from vllm_ext.etaps.linear_method import EtapsQuantizationConfig
    from vllm_ext.tvq.linear_method import TvqQuantizationConfig

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())

    def engine_config(additional: dict):
        # vLLM writes --gdn-prefill-backend into the same dict
        argv = ["--model", "facebook/opt-125m", "--gdn-prefill-backend", "triton",
                "--additional-config", json.dumps(additional)]  # fmt: skip
        return EngineArgs.from_cli_args(parser.parse_args(argv)).create_engine_config()

    config = engine_config(ADDITIONAL)
    assert config.additional_config == {**ADDITIONAL, "gdn_prefill_backend": "triton"}
    validate_additional_config(config.additional_config, environ={})
    assert config_from_vllm("leap", config).forgetting == 0.99
    assert config.compile_factors()["additional"] == config.additional_config
    changed = engine_config({**ADDITIONAL, "tvq": {"max_kernel_tokens": 4}})
    assert hash_factors(changed.compile_factors()) != hash_factors(config.compile_factors())
    tvq = TvqQuantizationConfig.from_config(QuantFormat(4, 16).to_dict())
    etaps = EtapsQuantizationConfig.from_config(SparseFormat(0.9).to_dict())
    with set_current_vllm_config(config):
        assert tvq.linear_method().max_kernel_tokens == 3
        assert etaps.linear_method().runtime.min_kernel_sparsity == 0.5


def _export(method: str, out) -> str:
    """The tiny Llama asset exported as a ``method`` checkpoint (MLPs, and for etaps attention)."""
    from transformers import AutoModelForCausalLM

    from vllm_ext.assets import model_path

    base = model_path("tiny-llama")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if method == "tvq":
        from vllm_ext.tvq.export import export
        from vllm_ext.tvq.qat import quantize_mlps

        quantize_mlps(model, 4, 16, kmeans_iters=2)
        return str(export(model, base, out, QuantFormat(4, 16)))
    from vllm_ext.etaps.baselines import prune_one_shot
    from vllm_ext.etaps.export import export

    prune_one_shot(model, 0.75)
    return str(export(model, base, out, 0.75))


def _reference(method: str, ckpt: str):
    if method == "tvq":
        from vllm_ext.tvq.export import load_reference
    else:
        from vllm_ext.etaps.export import load_reference
    return load_reference(ckpt)


@pytest.mark.parametrize("method", ["tvq", "etaps"])
def test_vllms_loader_fills_a_checkpoint_into_a_real_model(world_of_one, tmp_path, method):
    """0.34's ``LlamaForCausalLM`` loads an exported checkpoint (stacked ``gate_up_proj`` /
    ``qkv_proj`` shards mapped by the model's own ``load_weights``); every decoder layer's
    attention projections and MLP equal the dense reference model's."""
    from vllm.engine.arg_utils import EngineArgs

    ckpt = _export(method, tmp_path / "ckpt")
    _registered(method)
    # kernels for the 1-token call, dense matmuls for the 7-token one
    additional = {"tvq": {"max_kernel_tokens": 1}, "etaps": {"max_sparse_tokens": 1}}
    args = EngineArgs(model=ckpt, dtype="float32", max_model_len=256, additional_config=additional)
    config = args.create_engine_config()
    assert config.model_config.quantization == method
    model = model034_helpers.create_model(config)
    reference = _reference(method, ckpt)
    gen = torch.Generator().manual_seed(1)
    quantized = 0
    for ours, theirs in zip(model.model.layers, reference.model.layers, strict=True):
        quantized += type(ours.mlp.down_proj.quant_method).__name__ != "UnquantizedLinearMethod"
        attn = theirs.self_attn
        w_qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
        hidden, heads = attn.q_proj.in_features, attn.o_proj.in_features
        for tokens in (1, 7):
            x = torch.randn(tokens, hidden, generator=gen)
            h = torch.randn(tokens, heads, generator=gen)
            with torch.no_grad():
                mlp, want = ours.mlp(x), theirs.mlp(x)
                _check(ours.self_attn.qkv_proj(x)[0], x, w_qkv.detach())
                _check(ours.self_attn.o_proj(h)[0], h, attn.o_proj.weight.detach())
            err = ((mlp - want).abs().max() / (want.abs().max() + 1)).item()
            assert err < 1e-5, f"layer MLP off by {err}"
    assert quantized == len(model.model.layers)
