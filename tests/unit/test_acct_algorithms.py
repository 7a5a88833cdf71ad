"""ACCT algorithms on tiny random Llama configurations (no vLLM)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from vllm_ext.acct import checkpoint as ckpt
from vllm_ext.acct.converter import Converters
from vllm_ext.acct.data import Window, split_of
from vllm_ext.acct.gate import GateError, check_offline_gate, online_check
from vllm_ext.acct.llama import TorchLlama
from vllm_ext.acct.needle import exact_match, greedy_answer
from vllm_ext.acct.pipeline import AcctPipeline, continuation_logits, own_prefill
from vllm_ext.acct.quality import equal_compute_tokens, evaluate
from vllm_ext.acct.train import Trainer, TrainSettings, ridge_init, teacher

torch.set_num_threads(1)


def _random_config(seed: int):
    from transformers import LlamaConfig

    rng = np.random.default_rng(seed)
    kv_heads = int(rng.choice([1, 2]))
    heads = kv_heads * int(rng.choice([1, 2, 3]))
    head_dim = int(rng.choice([8, 16]))
    return LlamaConfig(
        hidden_size=int(rng.choice([32, 48])),
        intermediate_size=64,
        num_hidden_layers=int(rng.integers(2, 5)),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=97,
        rope_theta=float(rng.choice([1e4, 1e5])),
        rms_norm_eps=1e-5,
        tie_word_embeddings=bool(rng.integers(2)),
        max_position_embeddings=512,
        initializer_range=0.2,  # large enough weights that the context matters
    )


@pytest.fixture(scope="module", params=[0, 1, 2])
def tiny(request, tmp_path_factory):
    from transformers import LlamaForCausalLM

    torch.manual_seed(request.param)
    hf = LlamaForCausalLM(_random_config(request.param)).eval()
    folder = tmp_path_factory.mktemp(f"tiny{request.param}")
    hf.save_pretrained(folder, safe_serialization=True)
    return hf, folder, TorchLlama.from_pretrained(folder)


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(seed))


def test_forward_matches_transformers(tiny):
    hf, _, model = tiny
    ids = _ids(40)
    with torch.no_grad():
        ours, _ = model.forward_with_cache(ids, torch.arange(40))
        theirs = hf(ids[None]).logits[0]
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def test_continuation_over_own_cache_equals_full_forward(tiny):
    _, _, model = tiny
    ids = _ids(50)
    with torch.no_grad():
        full, _ = model.forward_with_cache(ids, torch.arange(50))
        cont = continuation_logits(model, own_prefill(model, ids[:37]), ids[37:])
    torch.testing.assert_close(cont, full[37:], atol=1e-5, rtol=1e-5)


def test_identity_import_reproduces_the_targets_logits_exactly(tiny):
    _, _, model = tiny
    ids = _ids(45, seed=1)
    pipeline = AcctPipeline(model, None)
    with torch.no_grad():
        imported, own = pipeline.build_cache(ids[:30]), own_prefill(model, ids[:30])
        for (k1, v1), (k2, v2) in zip(imported, own, strict=True):
            assert torch.equal(k1, k2) and torch.equal(v1, v2)
        assert torch.equal(
            continuation_logits(model, imported, ids[30:]),
            continuation_logits(model, own, ids[30:]),
        )
    assert pipeline.cost_layer_tokens(30) == 30 * model.shape.num_layers


def test_source_layers_and_sinks_are_exact_converted_layers_are_not(tiny):
    _, _, model = tiny
    shape = model.shape
    k, sinks = 1, 3
    converters = Converters(shape, k)
    for linear in converters.proj:
        torch.nn.init.normal_(linear.weight, std=0.3)
    pipeline = AcctPipeline(model, converters, sinks)
    ids = _ids(20, seed=2)
    with torch.no_grad():
        imported, own = pipeline.build_cache(ids), own_prefill(model, ids)
    for layer, ((k1, v1), (k2, v2)) in enumerate(zip(imported, own, strict=True)):
        assert k1.shape == k2.shape == (shape.num_kv_heads, 20, shape.head_dim)
        if layer < k:
            assert torch.equal(k1, k2) and torch.equal(v1, v2)
        else:
            torch.testing.assert_close(k1[:, :sinks], k2[:, :sinks], atol=1e-6, rtol=0)
            torch.testing.assert_close(v1[:, :sinks], v2[:, :sinks], atol=1e-6, rtol=0)
            assert not torch.allclose(v1[:, sinks:], v2[:, sinks:], atol=1e-3)
    assert pipeline.cost_layer_tokens(20) == k * 20 + (shape.num_layers - k) * sinks


def test_exact_tail_runs_the_targets_own_layers_over_the_import(tiny):
    _, _, model = tiny
    converters = Converters(model.shape, 1)
    for linear in converters.proj:
        torch.nn.init.normal_(linear.weight, std=0.3)
    ids = _ids(30, seed=5)
    with torch.no_grad():
        own = own_prefill(model, ids)
        # a tail covering every non-sink token: nothing converted, the target's own KV
        whole = AcctPipeline(model, converters, 3, tail_tokens=27).build_cache(ids)
        for (k1, v1), (k2, v2) in zip(whole, own, strict=True):
            torch.testing.assert_close(k1, k2, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(v1, v2, atol=1e-5, rtol=1e-5)
        part = AcctPipeline(model, converters, 3, tail_tokens=5)
        cache, plain = part.build_cache(ids), AcctPipeline(model, converters, 3).build_cache(ids)
    for layer in converters.layers:
        assert cache[layer][0].shape == own[layer][0].shape
        assert torch.equal(cache[layer][1][:, :25], plain[layer][1][:, :25])
        assert not torch.allclose(cache[layer][1][:, 25:], plain[layer][1][:, 25:])
    layers = model.shape.num_layers
    assert part.cost_layer_tokens(30) == 30 + (layers - 1) * (3 + 5)
    assert AcctPipeline(model, converters, 3, tail_tokens=50).cost_layer_tokens(30) == 30 * layers


def test_ridge_recovers_the_first_converted_layer_exactly(tiny):
    # target layer k's pre-RoPE K and V are linear in the RMS-normalised h_k: ridge finds them
    _, _, model = tiny
    k = model.shape.num_layers - 1
    converters = Converters(model.shape, k)
    windows = [Window("w", _ids(60, s).numpy(), _ids(4, s).numpy()) for s in range(3)]
    ridge_init(model, converters, windows, sink_tokens=2, alpha=1e-9)
    pipeline = AcctPipeline(model, converters.requires_grad_(False), 2)
    ids = _ids(40, seed=9)
    with torch.no_grad():
        (k1, v1), (k2, v2) = pipeline.build_cache(ids)[k], own_prefill(model, ids)[k]
    torch.testing.assert_close(k1, k2, atol=2e-3, rtol=1e-3)
    torch.testing.assert_close(v1, v2, atol=2e-3, rtol=1e-3)


def test_teacher_shares_the_sources_computation(tiny):
    _, _, model = tiny
    converters = Converters(model.shape, 1)
    window = Window("w", _ids(24).numpy(), _ids(6, 1).numpy())
    t = teacher(model, converters, window, 2)
    state = AcctPipeline(model, converters, 2).run_source(torch.as_tensor(window.context))
    torch.testing.assert_close(t.features, state.features, atol=1e-6, rtol=0)
    assert t.logits.shape == (6, model.shape.vocab_size)
    own = own_prefill(model, torch.as_tensor(window.context))
    torch.testing.assert_close(t.exact[0][1], own[0][1], atol=1e-6, rtol=0)
    assert set(t.sinks) == set(converters.layers)
    for j in converters.layers:
        torch.testing.assert_close(t.sinks[j][1], own[j][1][:, :2], atol=1e-6, rtol=0)


def test_kl_training_lowers_the_loss_and_resumes(tiny, tmp_path):
    _, folder, model = tiny
    settings = TrainSettings(
        source_layers=1,
        sink_tokens=2,
        context=24,
        continuation=8,
        steps=6,
        lr=1e-2,
        checkpoint_every=3,
        teacher_windows=1,
    )
    window = Window("w", _ids(24).numpy(), _ids(8, 50).numpy())
    trainer = Trainer(model, folder, tmp_path / "ck", settings)  # zero converters: V = 0
    trainer.train(iter([window]))  # one teacher, computed once, reused every step
    trainer.train(iter([]))  # done: needs no data
    kl = [h["kl"] for h in trainer.history]
    assert trainer.step == 6 and kl[-1] < 0.8 * kl[0], kl
    again = Trainer(model, folder, tmp_path / "ck", settings)
    assert again.resume() and again.step == 6
    for a, b in zip(again.converters.parameters(), trainer.converters.parameters(), strict=True):
        assert torch.equal(a, b)
    pipeline, meta = ckpt.load_pipeline(str(tmp_path / "ck"), folder, model)
    assert meta.source_layers == 1 and pipeline.sink_tokens == 2 and meta.gate is None


def test_checkpoint_for_another_model_is_refused(tiny, tmp_path):
    _, folder, model = tiny
    other = tmp_path / "other"
    other.mkdir()
    config = (folder / "config.json").read_text()
    config = config.replace('"num_hidden_layers": ', '"num_hidden_layers": 1')
    (other / "config.json").write_text(config)
    for file in folder.glob("*.safetensors"):
        (other / file.name).write_bytes(file.read_bytes()[:-1] + b"\x00")
    meta = ckpt.CheckpointMeta(ckpt.target_identity(other), 1, 2)
    ckpt.save(tmp_path / "ck", Converters(model.shape, 1), meta)
    with pytest.raises(ckpt.CheckpointError, match="num_layers.*weights_sha256"):
        ckpt.load_pipeline(str(tmp_path / "ck"), folder, model)


def test_offline_gate():
    good = {"delta_nll": 0.01, "top1": 0.99, "windows": 8}
    check_offline_gate(good, 0.05, 0.97, "ck")
    with pytest.raises(GateError, match="no offline gate"):
        check_offline_gate(None, 0.05, 0.97, "ck")
    with pytest.raises(GateError, match="delta NLL 0.5"):
        check_offline_gate({**good, "delta_nll": 0.5}, 0.05, 0.97, "ck")
    with pytest.raises(GateError, match="top-1"):
        check_offline_gate({**good, "top1": 0.5}, 0.05, 0.97, "ck")
    with pytest.raises(GateError):
        check_offline_gate({**good, "delta_nll": float("nan")}, 0.05, 0.97, "ck")


def test_online_check(tiny):
    _, _, model = tiny
    ids = _ids(40, seed=4)
    with torch.no_grad():
        own = own_prefill(model, ids)
        full, _ = model.forward_with_cache(ids, torch.arange(40))
    verdict = online_check(model, own, ids, tokens=8, sinks=2, max_gap=math.inf)
    expected = torch.nn.functional.cross_entropy(full[32:39], ids[33:40])
    assert verdict.passed and math.isclose(verdict.nll_import, float(expected), rel_tol=1e-4)
    broken = [(k, torch.full_like(v, float("nan"))) for k, v in own]
    assert not online_check(model, broken, ids, tokens=8, sinks=2, max_gap=math.inf).passed


def test_quality_identity_equals_own_and_equal_compute():
    torch.manual_seed(0)
    from vllm_ext.acct.llama import LlamaShape

    shape = LlamaShape(32, 3, 2, 1, 16, 64, 97, 1e4, 1e-5, True)
    model = TorchLlama(shape).eval().requires_grad_(False)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.2)
    windows = [Window("w", _ids(30, s).numpy(), _ids(10, s + 9).numpy()) for s in range(2)]
    result = evaluate(AcctPipeline(model, None), windows)
    assert result["means"]["acct"] == result["means"]["own"]
    assert result["means"]["own"]["top1"] == 1.0 and result["means"]["own"]["kl"] == 0.0
    assert set(result["means"]) == {"own", "acct", "truncated", "no_context"}
    k1 = AcctPipeline(model, Converters(shape, 1), sink_tokens=4)
    assert equal_compute_tokens(k1, 300) == math.ceil((300 + 2 * 4) / 3)
    assert equal_compute_tokens(AcctPipeline(model, None), 300) == 300


def test_split_is_deterministic_and_holds_some_out():
    ids = [f"conv{i}" for i in range(2000)]
    held = [i for i in ids if split_of(i) == "eval"]
    assert held == [i for i in ids if split_of(i) == "eval"]
    assert 100 < len(held) < 320


def test_greedy_answer_over_a_cache_equals_greedy_over_the_whole_sequence(tiny):
    _, _, model = tiny
    context, question = _ids(24, 5), _ids(5, 6)
    over_cache = greedy_answer(model, own_prefill(model, context), question, 24, 4)
    alone = greedy_answer(model, None, torch.cat([context, question]), 0, 4)
    assert over_cache == alone
    ids = torch.cat([context, question])
    for token in alone:  # one token at a time, the full forward's argmax
        logits, _ = model.forward_with_cache(ids, torch.arange(ids.shape[0]))
        assert int(logits[-1].argmax()) == token
        ids = torch.cat([ids, torch.tensor([token])])


def test_exact_match_reads_the_leading_number():
    assert exact_match(" 4821.", "4821") and exact_match("4821 is", "4821")
    assert not exact_match(" 48210", "4821") and not exact_match(" code 4821", "4821")
