"""Equal-bit baselines: round-to-nearest per row/group, calibration Hessians, layer-wise refit."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vllm_ext.tvq.baselines import input_hessians, output_error, refine_layerwise, rtn
from vllm_ext.tvq.qat import VQLinear

torch.set_num_threads(1)


@pytest.mark.parametrize("seed", range(4))
def test_rtn_uses_at_most_2_to_the_bits_levels_per_group_and_more_bits_help(seed):
    gen = torch.Generator().manual_seed(seed)
    rows, group = int(torch.randint(2, 9, (1,), generator=gen)), [4, 8, 16][seed % 3]
    w = torch.randn(rows, group * int(torch.randint(1, 5, (1,), generator=gen)), generator=gen)
    errors = []
    for bits in (2, 3, 4):
        q = rtn(w, bits, group)
        for part in q.reshape(rows, -1, group).reshape(-1, group):
            assert len(torch.unique(part)) <= 2**bits
        # min and max of each group are kept exactly (asymmetric min/max grid)
        blocks = w.reshape(rows, -1, group)
        qb = q.reshape(rows, -1, group)
        torch.testing.assert_close(qb.amin(-1), blocks.amin(-1), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(qb.amax(-1), blocks.amax(-1), rtol=1e-5, atol=1e-5)
        errors.append(float((q - w).pow(2).mean()))
    assert errors[0] > errors[1] > errors[2]
    with pytest.raises(ValueError, match="multiple"):
        rtn(w, 3, w.shape[1] + 1)


def test_input_hessians_are_the_mean_outer_product_of_the_inputs():
    torch.manual_seed(0)
    lin = nn.Linear(6, 3)
    model = nn.Sequential(lin)
    chunks = torch.randn(2, 5, 6)
    h = input_hessians(model, chunks, ["0"])["0"]
    x = chunks.reshape(-1, 6)
    torch.testing.assert_close(h, x.T @ x / x.shape[0])


@pytest.mark.parametrize("seed", range(3))
def test_layerwise_refit_never_raises_the_layers_output_error(seed):
    torch.manual_seed(seed)
    lin = nn.Linear(16, 12, bias=False)
    vq = VQLinear(lin, 4, 8, kmeans_iters=2)
    x = torch.randn(64, 16) * torch.linspace(0.1, 3.0, 16)  # uneven input energy
    h = x.T @ x / 64
    before, after = refine_layerwise(vq, h, steps=20)
    assert after <= before + 1e-9
    torch.testing.assert_close(vq.weight, lin.weight)  # the latent (original weight) is kept
    assert float(output_error(vq, lin.weight.detach(), h)) == pytest.approx(after)
