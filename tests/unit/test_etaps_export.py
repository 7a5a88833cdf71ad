"""ETAPS sparse format, exporter, SparseGPT and the CLI (torch only, no vLLM)."""

from __future__ import annotations

import json

import pytest
import torch

from vllm_ext.etaps.schedule import pruned_per_row
from vllm_ext.etaps.scores import magnitude_score, row_mask
from vllm_ext.etaps.sparse_format import SparseFormat, compact
from vllm_ext.etaps.sparsegpt import sparsegpt_prune
from vllm_ext.kernels.sparse_gemv import densify_ref

pytestmark = pytest.mark.unit


def _pruned(seed: int):
    gen = torch.Generator().manual_seed(seed)
    rows, cols = (int(v) for v in torch.randint(1, 200, (2,), generator=gen))
    sparsity = 0.05 + 0.9 * float(torch.rand(1, generator=gen))
    w = torch.randn(rows, cols, generator=gen).bfloat16().float()
    return w * row_mask(magnitude_score(w), sparsity), sparsity


@pytest.mark.parametrize("seed", range(6))
def test_compact_round_trips_row_pruned_weights(seed):
    w, sparsity = _pruned(seed)
    fmt = SparseFormat(sparsity)
    w[0, : w.shape[1] // 3] = 0.0  # a row with fewer non-zeros than nnz is padded
    values, indices = compact(w, fmt.nnz(w.shape[1]))
    assert values.dtype == torch.bfloat16 and indices.dtype == torch.int16
    assert values.shape == (w.shape[0], w.shape[1] - pruned_per_row(w.shape[1], sparsity))
    assert bool((indices[:, 1:] > indices[:, :-1]).all())  # sorted, no duplicates
    assert torch.equal(densify_ref(values, indices, w.shape[1]).float(), w)


def test_compact_rejects_a_weight_not_pruned_to_the_sparsity():
    with pytest.raises(ValueError, match="not pruned"):
        compact(torch.ones(3, 10), SparseFormat(0.5).nnz(10))
    with pytest.raises(ValueError, match="sparsity"):
        SparseFormat.from_dict({"quant_method": "etaps"})
    with pytest.raises(ValueError, match=r"\(0, 1\)"):
        SparseFormat.from_dict({"sparsity": 1.0})


@pytest.mark.parametrize("seed", range(4))
def test_sparsegpt_prunes_exactly_per_row_and_beats_magnitude(seed):
    gen = torch.Generator().manual_seed(seed)
    rows, cols = int(torch.randint(8, 64, (1,), generator=gen)), 150
    sparsity = [0.5, 0.6, 0.7, 0.9][seed]
    w = torch.randn(rows, cols, generator=gen)
    x = torch.randn(600, cols, generator=gen) @ torch.randn(cols, cols, generator=gen)
    pruned = sparsegpt_prune(w, x.T @ x, sparsity, block=64)
    assert set((pruned != 0).sum(1).tolist()) == {cols - pruned_per_row(cols, sparsity)}
    magnitude = w * row_mask(magnitude_score(w), sparsity)

    def err(a):
        return float(((x @ (a - w).T) ** 2).sum())

    assert err(pruned) < err(magnitude)


@pytest.fixture(scope="module")
def tiny():
    from vllm_ext.assets import model_path
    from vllm_ext.etaps.model_io import load_model

    return model_path("tiny-llama"), load_model(model_path("tiny-llama"))[0]


def test_export_then_load_reference_gives_the_masked_bf16_model(tiny, tmp_path):
    from vllm_ext.etaps.baselines import prune_one_shot
    from vllm_ext.etaps.export import export, load_reference
    from vllm_ext.etaps.model_io import prunable_linears

    base, model = tiny
    prune_one_shot(model, 0.8)
    ckpt = export(model, base, tmp_path / "ckpt", 0.8)
    assert json.loads((ckpt / "config.json").read_text())["quantization_config"] == (
        SparseFormat(0.8).to_dict()
    )
    back = load_reference(ckpt)
    for name, linear in prunable_linears(model).items():
        got = back.get_submodule(name).weight
        assert torch.equal(got, linear.weight.bfloat16().float()), name
    ids = torch.tensor([[3, 9, 27, 81]])
    with torch.no_grad():
        assert torch.allclose(back(ids).logits, model.bfloat16().float()(ids).logits, atol=1e-4)


def test_cli_prunes_resumes_exports_and_evaluates(tmp_path, capsys):
    from vllm_ext.etaps.cli import main

    out = tmp_path / "run"
    argv = ["--threads", "1", "prune", "--base", "tiny-llama", "--out", str(out),
            "--final-sparsity", "0.7", "--stages", "2", "--start-sparsity", "0.5",
            "--calib-blocks", "1", "--train-steps", "1", "--block-len", "16"]  # fmt: skip
    assert main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert [s["sparsity"] for s in summary["log"]] == [0.5, 0.7]
    assert 0 < summary["pruner_state_bytes"] < summary["model_bytes"]
    assert main(argv) == 0 and "resumed after stage 2 of 2" in capsys.readouterr().out
    assert main(["eval", "--ckpt", str(out / "ckpt-70"), "--blocks", "1", "--block-len", "16"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["ppl"] > 1


def test_cli_admm_baseline_exports_a_checkpoint_at_the_sparsity(tmp_path, capsys):
    from vllm_ext.etaps.cli import main
    from vllm_ext.etaps.export import load_reference
    from vllm_ext.etaps.model_io import prunable_linears

    out = tmp_path / "admm"
    argv = ["--threads", "1", "prune", "--method", "admm", "--base", "tiny-llama",
            "--out", str(out), "--final-sparsity", "0.6", "--calib-blocks", "2",
            "--block-len", "16"]  # fmt: skip
    assert main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["method"] == "admm" and len(summary["loss"]) == 2 and summary["tokens"] == 32
    back = load_reference(out / "ckpt-60")
    linears = prunable_linears(back)
    # fp32 Z, U, a gradient and two Adam moments for every prunable weight
    prunable_fp32_bytes = 4 * sum(linear.weight.numel() for linear in linears.values())
    assert summary["pruner_state_bytes"] >= 5 * prunable_fp32_bytes
    for name, linear in linears.items():
        zeros = (linear.weight == 0).sum(1)
        assert bool((zeros >= pruned_per_row(linear.in_features, 0.6)).all()), name
