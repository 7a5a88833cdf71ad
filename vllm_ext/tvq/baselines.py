"""Baselines at equal bits: round-to-nearest scalar quantization and layer-wise VQ refinement.

- :func:`rtn` is asymmetric min/max round-to-nearest per group of ``group``
  consecutive input weights (``group = cols``: one scale and zero per row);
  its storage is ``bits + 32 / group`` bits per weight (bf16 scale and zero).
- :func:`refine_layerwise` is the AQLM-style output-matching step of a
  layer-wise VQ with no end-to-end training: with the calibration Hessian
  ``H = X^T X`` of the layer's inputs, the codebook and row scales minimise
  ``tr((W - W_q) H (W - W_q)^T)`` (the layer's output error on the calibration
  tokens) by Adam, alternating with a nearest-codeword re-lookup.
"""

from __future__ import annotations

import torch

from vllm_ext.tvq.qat import MLP_LINEARS, VQLinear


def rtn(weight: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """``weight [rows, cols]`` rounded to ``2**bits`` levels per group (dequantized, fp32)."""
    rows, cols = weight.shape
    if cols % group:
        raise ValueError(f"input size {cols} is not a multiple of the RTN group {group}")
    if not 1 <= bits <= 16:
        raise ValueError(f"RTN bits must be in 1..16, got {bits}")
    w = weight.float().reshape(rows, cols // group, group)
    lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    step = ((hi - lo) / (2**bits - 1)).clamp_min(1e-12)
    q = ((w - lo) / step).round().clamp(0, 2**bits - 1)
    return (q * step + lo).reshape(rows, cols)


def rtn_bits_per_weight(bits: int, group: int, side_bits: int = 32) -> float:
    return bits + side_bits / group


@torch.no_grad()
def apply_rtn(model: torch.nn.Module, bits: int, group: int | None) -> int:
    """Round every decoder MLP linear of ``model`` in place (``group=None``: per row)."""
    n = 0
    for module in model.modules():
        for attr in MLP_LINEARS:
            child = getattr(module, attr, None)
            if isinstance(child, torch.nn.Linear):
                w = child.weight
                w.copy_(rtn(w, bits, group or w.shape[1]).to(w.dtype))
                n += 1
    return n


@torch.no_grad()
def input_hessians(model: torch.nn.Module, chunks: torch.Tensor, names) -> dict[str, torch.Tensor]:
    """``X^T X / n`` of the inputs of the named modules over the calibration ``chunks``."""
    acc: dict[str, torch.Tensor] = {}
    count: dict[str, int] = {}
    modules = dict(model.named_modules())
    hooks = []
    for name in names:

        def hook(_m, args, name=name):
            x = args[0].reshape(-1, args[0].shape[-1]).float()
            acc[name] = acc.get(name, 0) + x.T @ x
            count[name] = count.get(name, 0) + x.shape[0]

        hooks.append(modules[name].register_forward_pre_hook(hook))
    try:
        for chunk in chunks:
            model(chunk[None])
    finally:
        for h in hooks:
            h.remove()
    return {name: acc[name] / count[name] for name in acc}


def output_error(vq: VQLinear, target: torch.Tensor, hessian: torch.Tensor) -> torch.Tensor:
    """``tr(dW H dW^T) / tr(W H W^T)``: the relative output error on the calibration inputs."""
    delta = vq.quantized_weight() - target
    return (delta @ hessian * delta).sum() / (target @ hessian * target).sum().clamp_min(1e-12)


def refine_layerwise(vq: VQLinear, hessian: torch.Tensor, steps: int, rounds: int = 2,
                     lr: float = 1e-3) -> tuple[float, float]:  # fmt: skip
    """Fit ``vq``'s codebook and scales to its own layer's outputs; (error before, after).

    The latent ``vq.weight`` is the original weight and stays fixed (no
    training beyond this layer's output-matching objective).
    """
    target = vq.weight.detach().clone()
    with torch.no_grad():
        before = float(output_error(vq, target, hessian))
    side = [vq.codebook, vq.scale]
    for _ in range(rounds):
        opt = torch.optim.Adam(side, lr=lr)
        for p in side:
            p.requires_grad_(True)
        for _ in range(steps):
            loss = output_error(vq, target, hessian)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        for p in side:
            p.requires_grad_(False)
        with torch.no_grad():
            vq.scale.clamp_(min=1e-8)
            # the re-lookup is plain L2, not H-weighted: keep it only if it helps
            old, err = vq.codes.clone(), output_error(vq, target, hessian)
            vq.relookup()
            if output_error(vq, target, hessian) > err:
                vq.codes.copy_(old)
    with torch.no_grad():
        after = float(output_error(vq, target, hessian))
    return before, after
