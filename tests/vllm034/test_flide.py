"""Flide's packed pass through models vLLM 0.34 builds and loads, against separate computation.

Flide needs nothing from a model runner but its loaded model and its
``VllmConfig`` (``FlideWorkerExtension`` runs between engine steps through
``collective_rpc``): the pass runs the model's own decoder layers with vLLM's
``Attention`` and ``QwenGatedDeltaNetAttention`` swapped for packed stand-ins.
So Model Runner V2 (0.34's only runner) needs no port; what changes with the
release is the model code the pass walks. Here 0.34's loader builds random
tiny Llama and Qwen3 models on the CPU, and every (question, label)
log-probability of a packed call must equal an fp32 transformers forward of
``context + question + label`` alone on the same weights.

Gated DeltaNet hybrids are covered by structure only: 0.34's CPU loader
itself packs their conv taps with a compiled op
(``vllm._cpu_ops.causal_conv1d_weight_pack``) that exists only in a 0.34 CPU
build, and Flide's CPU pass calls 0.34's compiled GDN ops (``compat.locate``
finds them in ``vllm._cpu_ops``). So a 0.34 Qwen3-Next is built without its
weights, and the attributes and swaps the pass relies on are checked on it.
"""

from __future__ import annotations

import model034_helpers
import pytest

from benchmarks.flide import exactness as ex
from vllm_ext.flide.batch import Item, label_logprobs, pack_items

SEED = 2034
# worst |logprob - fp32 truth| (nats); bf16 as tests/engine/test_flide_exactness.py
TOLERANCE = {"float32": 1e-3, "bfloat16": 0.05}
CASES = [("llama", "float32"), ("qwen3", "float32"), ("llama", "bfloat16")]


@pytest.fixture(scope="module")
def world_of_one():
    with model034_helpers.world_of_one():
        yield


@pytest.fixture(scope="module", params=CASES, ids=[f"{a}-{d}" for a, d in CASES])
def served(request, world_of_one, tmp_path_factory):
    """A random tiny model loaded by 0.34, its ``VllmConfig`` and its fp32 transformers twin."""
    from vllm.engine.arg_utils import EngineArgs

    name, dtype = request.param
    seed = SEED + CASES.index(request.param)
    path = tmp_path_factory.mktemp(f"{name}-{dtype}")
    ex.build_model(ex.ARCHS[name], seed, path)
    config = EngineArgs(model=str(path), dtype=dtype, max_model_len=2048).create_engine_config()
    model = model034_helpers.create_model(config)
    return ex.ARCHS[name], dtype, seed, config, model, ex.load_truth_model(path)


def _flide(model, config, call, isolate: bool = True) -> list[list[float]]:
    from vllm.config import set_current_vllm_config

    from vllm_ext.flide.forward import packed_logprobs

    items = [Item(tuple(c), tuple(tuple(q) for q in qs)) for c, qs in call.items]
    batch = pack_items(items, [tuple(label) for label in call.labels], isolate=isolate)
    with set_current_vllm_config(config):
        return label_logprobs(batch, packed_logprobs(model, config, batch).cpu()).tolist()


def _worst(got: list[list[float]], truth: list[list[float]]) -> float:
    pairs = zip(got, truth, strict=True)
    return max(abs(a - b) for g, t in pairs for a, b in zip(g, t, strict=True))


def test_the_packed_pass_equals_each_lineage_alone(served):
    from vllm_ext.flide.forward import check_supported

    arch, dtype, seed, config, model, truth_model = served
    check_supported(model, config.model_config.architecture)
    for n, call in enumerate(ex.random_calls(seed, short=4)):
        truth = ex.truth_logprobs(truth_model, call).logprobs
        worst = _worst(_flide(model, config, call), truth)
        assert worst <= TOLERANCE[dtype], f"{arch.name} {dtype} seed {seed} call {n}: {worst}"


def test_naive_packing_is_caught(served):
    """The comparison above sees interference: one causal sequence of every question is off."""
    arch, dtype, seed, config, model, truth_model = served
    if dtype != "float32":
        pytest.skip("one dtype shows it")
    calls = [c for c in ex.random_calls(seed, short=4) if max(len(qs) for _, qs in c.items) > 1]
    assert calls, "no call with two questions on one context"
    call = calls[0]
    truth = ex.truth_logprobs(truth_model, call).logprobs
    assert _worst(_flide(model, config, call, isolate=False), truth) > 10 * TOLERANCE[dtype]


def test_flides_seams_hold_on_0_34():
    from vllm_ext.common import compat

    assert compat.problems("flide", "v2") == []
    # the CPU ops moved in 0.34; locate finds them at their new home
    assert compat.locate("flide", "chunk_gated_delta_rule_cpu").__module__ == "vllm._cpu_ops"


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_every_layer_of_a_0_34_hybrid_gets_its_stand_in(world_of_one, dtype):
    """On 0.34's Qwen3-Next (structure only, see the module doc): the layer attributes the
    packed pass reads exist on the real instances, every attention and Gated DeltaNet layer
    is swapped for its stand-in and restored, and fp32 is refused by name on the CPU."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
        QwenGatedDeltaNetAttention,
    )

    from vllm_ext.assets import model_path
    from vllm_ext.flide import forward

    args = EngineArgs(model=str(model_path("tiny-hybrid")), dtype=dtype, max_model_len=512)
    config = args.create_engine_config()
    model = model034_helpers.create_model(config, load=False)
    architecture = config.model_config.architecture
    if dtype == "float32":
        with pytest.raises(forward.UnsupportedModelError, match="bf16 only"):
            forward.check_supported(model, architecture)
        return
    forward.check_supported(model, architecture)

    def kinds() -> dict[str, int]:
        found: dict[str, int] = {}
        for module in model.modules():
            for cls in (Attention, QwenGatedDeltaNetAttention, forward.PackedAttention,
                        forward.PackedGatedDeltaNet):  # fmt: skip
                if isinstance(module, cls):
                    found[cls.__name__] = found.get(cls.__name__, 0) + 1
        return found

    before = kinds()
    assert before == {"Attention": 2, "QwenGatedDeltaNetAttention": 2}
    batch = pack_items([Item((5, 6, 7), ((8,), (9, 10)))], [(11,), (12,)])
    with forward._stand_ins(model, batch.layout):
        assert kinds() == {"PackedAttention": 2, "PackedGatedDeltaNet": 2}
    assert kinds() == before
