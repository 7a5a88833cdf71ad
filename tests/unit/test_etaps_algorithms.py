"""ETAPS algorithm modules: schedule, score, masks, slot migration, resume (no vLLM)."""

from __future__ import annotations

import pytest
import torch

from vllm_ext.etaps.schedule import pruned_per_row, sparsity_schedule
from vllm_ext.etaps.scores import etaps_score, row_mask, wanda_score
from vllm_ext.etaps.slots import dense_delta, initial_slots, migrate_slots

pytestmark = pytest.mark.unit


def test_schedule_rises_to_final_and_includes_checkpoints():
    assert sparsity_schedule(0.9, 5, start=0.5) == [0.5, 0.6, 0.7, 0.8, 0.9]
    assert sparsity_schedule(0.9, 2, start=0.5, checkpoints=(0.7,)) == [0.5, 0.7, 0.9]
    assert sparsity_schedule(0.6, 1) == [0.6]
    for bad in ((1.0, 3), (0.9, 0), (0.0, 2)):
        with pytest.raises(ValueError):
            sparsity_schedule(*bad)
    assert pruned_per_row(576, 0.7) == 403 and pruned_per_row(10, 0.9) == 9


def test_etaps_score_is_patched_weight_times_grad():
    w = torch.tensor([[1.0, -2.0]])
    d = torch.tensor([[0.5, 0.0]])
    g = torch.tensor([[2.0, 3.0]])
    assert torch.equal(etaps_score(w, d, g), torch.tensor([[3.0, 6.0]]))
    assert torch.allclose(wanda_score(w, torch.tensor([4.0, 9.0])), torch.tensor([[2.0, 6.0]]))


@pytest.mark.parametrize("seed", range(6))
def test_row_mask_prunes_lowest_per_row_and_is_monotone(seed):
    gen = torch.Generator().manual_seed(seed)
    rows, cols = torch.randint(1, 9, (2,), generator=gen).tolist()
    cols += 4
    score = torch.rand(rows, cols, generator=gen)
    first = row_mask(score, 0.5)
    assert (first.sum(1) == cols - pruned_per_row(cols, 0.5)).all()
    kept_min = score.masked_fill(~first, 2).min(1).values
    pruned_max = score.masked_fill(first, -1).max(1).values
    assert (pruned_max <= kept_min).all()
    second = row_mask(torch.rand(rows, cols, generator=gen), 0.75, keep=first)
    assert not (second & ~first).any()  # nothing pruned comes back
    assert (second.sum(1) == cols - pruned_per_row(cols, 0.75)).all()


@pytest.mark.parametrize("seed", range(10))
def test_slot_migration_invariants(seed):
    gen = torch.Generator().manual_seed(seed)
    rows, cols = torch.randint(4, 16, (2,), generator=gen).tolist()
    grad = torch.rand(rows, cols, generator=gen)
    keep = torch.ones(rows, cols, dtype=torch.bool)
    n_slots = max(1, rows * cols // 10)
    slots = initial_slots(grad, keep, n_slots)
    assert torch.equal(slots, torch.topk(grad.flatten(), n_slots).indices.sort().values)
    delta = torch.randn(n_slots, generator=gen)
    for sparsity in (0.3, 0.6, 0.8):
        keep = row_mask(torch.rand(rows, cols, generator=gen), sparsity, keep=keep)
        grad = torch.rand(rows, cols, generator=gen)
        before = dict(zip(slots.tolist(), delta.tolist(), strict=True))
        slots, delta, moved = migrate_slots(slots, delta, grad, keep)
        assert slots.numel() == n_slots  # fixed slot count
        assert slots.unique().numel() == n_slots  # no two slots on one weight
        assert keep.flatten()[slots].all()  # never on a pruned weight
        assert (delta[moved] == 0).all()
        for s, d in zip(slots[~moved].tolist(), delta[~moved].tolist(), strict=True):
            assert before[s] == d  # survivors keep their increment
        if moved.any():  # moved slots took the best free survivors
            free = keep.flatten().clone()
            free[slots[~moved]] = False
            best = grad.flatten().masked_fill(~free, -1).topk(int(moved.sum())).values
            assert torch.equal(grad.flatten()[slots[moved]].sort().values, best.sort().values)


def test_dense_delta_scatters_and_carries_grad():
    delta = torch.tensor([1.0, 2.0], requires_grad=True)
    dense = dense_delta(torch.tensor([0, 5]), delta, torch.Size([2, 3]))
    assert dense.tolist() == [[1.0, 0, 0], [0, 0, 2.0]]
    (dense * torch.arange(6.0).view(2, 3)).sum().backward()
    assert delta.grad.tolist() == [0.0, 5.0]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_slotted_linear_accumulates_per_token_abs_gradients(seed):
    from vllm_ext.etaps.slotted import SlottedLinear

    g = torch.Generator().manual_seed(seed)
    rows, cols, tokens = torch.randint(2, 9, (3,), generator=g).tolist()
    layer = SlottedLinear(torch.nn.Linear(cols, rows), n_slots=2)
    x = torch.randn(2, tokens, cols, generator=g)
    upstream = torch.randn(2, tokens, rows, generator=g)
    layer.tracking = True
    (layer(x) * upstream).sum().backward()
    expected = upstream.reshape(-1, rows).abs().t() @ x.reshape(-1, cols).abs()
    torch.testing.assert_close(layer.grad_sum, expected)
    full_grad = upstream.reshape(-1, rows).t() @ x.reshape(-1, cols)  # dL/dW of the block
    assert bool((layer.grad_sum >= full_grad.abs() - 1e-5).all())
    layer.tracking = False
    (layer(x) * upstream).sum().backward()  # not tracking: nothing added
    torch.testing.assert_close(layer.grad_sum, expected)
