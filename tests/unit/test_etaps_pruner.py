"""The staged pruner on a tiny random Llama: masks, slots, export values, resume."""

from __future__ import annotations

import pytest
import torch

from tests.etaps_models import tiny_llama
from vllm_ext.etaps.pruner import PruneSettings, StagedPruner
from vllm_ext.etaps.schedule import pruned_per_row

pytestmark = pytest.mark.unit


SETTINGS = PruneSettings(
    final_sparsity=0.8,
    stages=3,
    start_sparsity=0.4,
    calib_blocks=1,
    train_steps=2,
    block_len=16,
    slot_fraction=0.05,
)


def _blocks(seed: int) -> torch.Tensor:
    n = len(SETTINGS.targets()) * SETTINGS.blocks_per_stage()
    return torch.randint(
        0, 64, (n, SETTINGS.block_len), generator=torch.Generator().manual_seed(seed)
    )


def test_stages_prune_monotonically_and_keep_slots_on_survivors(tmp_path):
    model = tiny_llama(0)
    pruner = StagedPruner(model, SETTINGS, tmp_path)
    masks = []
    pruner.run(
        _blocks(0),
        on_stage=lambda s, p: masks.append(
            {n: layer.keep.clone() for n, layer in p.layers.items()}
        ),
    )
    assert [e["sparsity"] for e in pruner.log] == SETTINGS.targets()
    for name, layer in pruner.layers.items():
        for earlier, later in zip(masks, masks[1:], strict=False):
            assert not (later[name] & ~earlier[name]).any()
        cols = layer.weight.shape[1]
        assert (layer.keep.sum(1) == cols - pruned_per_row(cols, 0.8)).all()
        assert layer.keep.flatten()[layer.slots].all()
        assert layer.slots.unique().numel() == layer.n_slots
        assert layer.delta.abs().sum() > 0  # the increments were trained
        patched = pruner.patched_state_dict()[f"{name}.weight"]
        assert not patched[~layer.keep].any()
    assert pruner.state_bytes() > 0


def test_resume_continues_bit_for_bit(tmp_path):
    full = StagedPruner(tiny_llama(1), SETTINGS, tmp_path / "full")
    full.run(_blocks(1))

    class Stop(Exception):
        pass

    def stop_after_first(_s, _p):
        raise Stop

    first = StagedPruner(tiny_llama(1), SETTINGS, tmp_path / "cut")
    with pytest.raises(Stop):
        first.run(_blocks(1), on_stage=stop_after_first)
    resumed = StagedPruner(tiny_llama(1), SETTINGS, tmp_path / "cut")
    assert resumed.resume() and resumed.done == 1
    resumed.run(_blocks(1))
    a, b = full.patched_state_dict(), resumed.patched_state_dict()
    for key in a:
        assert torch.allclose(a[key], b[key], atol=1e-6), key


def test_resume_refuses_other_settings(tmp_path):
    StagedPruner(tiny_llama(2), SETTINGS, tmp_path).save()
    other = PruneSettings(final_sparsity=0.7, stages=2, block_len=16)
    with pytest.raises(ValueError, match="other settings"):
        StagedPruner(tiny_llama(2), other, tmp_path).resume()
