"""One packed forward pass through a model vLLM has loaded (vLLM 0.32 checked).

The model's own decoder layers run unchanged; only the two modules whose
result depends on sequence structure are stood in for, for the duration of
the pass:

- vLLM's ``Attention`` (paged, causal) → :class:`PackedAttention`
  (segment-masked, :mod:`vllm_ext.kernels.packed_attention`);
- ``QwenGatedDeltaNetAttention`` → :class:`PackedGatedDeltaNet`, which reuses
  the layer's projections, gated norm and output projection and runs the
  convolution and delta rule per lineage (:mod:`vllm_ext.flide.recurrent`).

Nothing touches the KV cache or the recurrent-state pool, so the pass cannot
disturb requests the engine is serving.

Where Flide's rounding can differ from a separate vLLM request (the math is
the same; the drift from an fp32 forward is measured against vLLM's own by
``tests/engine/test_flide_exactness.py`` and ``benchmarks/flide/drift.py``):

- the GDN convolution and gates: none on CPU (vLLM's own ops, each segment
  starting from its lineage's conv state); on CUDA the torch
  :func:`~vllm_ext.flide.recurrent.lineage_conv` (fp32, rounded once);
- attention is computed in fp32 from the bf16 q/k/v and rounded once, where
  vLLM's kernels may round inside (e.g. the softmax weights);
- the delta rule's 64-token chunk grid starts at each segment's first token
  (a question restarts from its context's final state), where a separate
  request's grid starts at the context's first token: the same recurrence,
  summed in another order;
- matmuls see other batch shapes than vLLM's (as any two vLLM batches do).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from vllm.forward_context import set_forward_context
from vllm.model_executor.layers.attention.attention import Attention
from vllm.model_executor.layers.mamba.gdn.base import GatedDeltaNetAttention
from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention

from vllm_ext.common import compat
from vllm_ext.flide.batch import PackedBatch
from vllm_ext.flide.packing import PackedLayout, key_start, lineage_window
from vllm_ext.flide.recurrent import DeltaRule, gdn_gating, lineage_conv, segmented_delta_rule
from vllm_ext.kernels.packed_attention import packed_attention
from vllm_ext.kernels.packed_attention.blocks import packed_attention_blocks

# architectures whose packed pass is tested against separate requests and an fp32 forward
# on random tiny configurations (tests/engine/test_flide_exactness.py)
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3NextForCausalLM",
    "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForCausalLM",
)
# vLLM 0.32 models with a Gated DeltaNet Flide cannot pack, and why
UNPACKABLE = {
    "OlmoHybridForCausalLM": "its Gated DeltaNet layer (OlmoHybridGatedDeltaNetAttention) has "
    "no packed stand-in (and no CPU path in vLLM)",
    "Qwen3_5ForConditionalGeneration": "multimodal wrapper; serve the text model "
    "(Qwen3_5ForCausalLM)",
    "Qwen3_5MoeForConditionalGeneration": "multimodal wrapper; serve the text model "
    "(Qwen3_5MoeForCausalLM)",
    "InternS2MobiusForCausalLM": "not tested (transformers has no implementation to check "
    "it against)",
    "InternS2MobiusForConditionalGeneration": "multimodal wrapper, not tested",
    "MiniCPMV4_6ForConditionalGeneration": "multimodal wrapper, not tested",
}


class UnsupportedModelError(ValueError):
    """The served model has a layer or architecture the packed pass cannot run."""


class PackedAttention(nn.Module):
    """Stands in for one vLLM ``Attention`` layer during a packed pass."""

    def __init__(self, attn: Attention, layout: PackedLayout, starts: torch.Tensor) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = attn.num_heads, attn.num_kv_heads
        self.head_size, self.head_size_v = attn.head_size, attn.head_size_v
        self.scale = float(attn.impl.scale)
        self.layout, self.starts = layout, starts

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
        q = query.view(-1, self.num_heads, self.head_size)
        k = key.view(-1, self.num_kv_heads, self.head_size)
        v = value.view(-1, self.num_kv_heads, self.head_size_v)
        layout = self.layout
        if q.is_cuda or os.environ.get("VLLMEXT_KERNELS_FORCE_REF") == "1":
            out = packed_attention(q, k, v, layout.segment_of, layout.visible, self.scale,
                                   self.starts)  # fmt: skip
        else:
            out = packed_attention_blocks(
                q, k, v, layout.starts, layout.ends, layout.parent, self.scale
            )
        return out.reshape(q.shape[0], self.num_heads * self.head_size_v)


class PackedGatedDeltaNet(nn.Module):
    """Stands in for one ``QwenGatedDeltaNetAttention`` layer during a packed pass."""

    def __init__(self, layer, layout: PackedLayout, window: torch.Tensor, kernel: DeltaRule):
        super().__init__()
        # a plain attribute, not a submodule: the layer stays owned by the model
        self.__dict__["layer"] = layer
        self.layout, self.window, self.kernel = layout, window, kernel

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        layer = self.layer
        mixed_qkv, z, b, a = _gdn_projections(layer, hidden_states)
        if mixed_qkv.is_cuda:
            mixed_qkv = lineage_conv(
                mixed_qkv, _conv_weight(layer), layer.conv1d.bias, self.window, layer.activation
            )
            g, beta = gdn_gating(a, b, layer.A_log, layer.dt_bias)
        else:
            # vLLM's own CPU ops, so that every rounding is the one vLLM makes
            mixed_qkv = cpu_lineage_conv(layer, mixed_qkv, self.layout, self.window)
            g, beta = cpu_gdn_gating(layer, a, b)
        query, key, value = layer.rearrange_mixed_qkv(mixed_qkv)
        core = segmented_delta_rule(
            self.layout, query[0], key[0], value[0], g, beta.to(value.dtype), self.kernel
        )
        return layer._output_projection(core.to(hidden_states.dtype), z)


def _gdn_projections(layer, hidden_states: torch.Tensor):
    """``mixed_qkv [T, C], z [T, H, V], b, a [T, H]`` — as the layer's own ``forward_cpu``."""
    mixed_qkvz, _ = layer.in_proj_qkvz(hidden_states)
    ba, _ = layer.in_proj_ba(hidden_states)
    if layer.gqa_interleaved_layout:
        query, key, value, z, b, a = layer.fix_query_key_value_ordering(mixed_qkvz, ba)
        num = hidden_states.shape[0]
        mixed_qkv = torch.cat([t.reshape(num, -1) for t in (query, key, value)], dim=-1)
        return mixed_qkv, z, b, a
    qkv_size = (layer.key_dim * 2 + layer.value_dim) // layer.tp_size
    mixed_qkv, z = mixed_qkvz.split([qkv_size, layer.value_dim // layer.tp_size], dim=-1)
    b, a = ba.chunk(2, dim=-1)
    return mixed_qkv, z.reshape(z.shape[0], -1, layer.head_v_dim), b, a


def cpu_lineage_conv(layer, x: torch.Tensor, layout: PackedLayout, window: torch.Tensor):
    """The layer's causal conv over every segment through the CPU op vLLM's GDN path calls.

    Each segment is one sequence of the varlen call whose initial conv state
    is the ``w - 1`` lineage inputs before its first token (its context's
    tail for a question; zeros for a context), so every token reads what it
    reads in a separate request. ``x: [T, C]`` bf16; returns ``[T, C]``.
    """
    x = x.contiguous()  # the op reads x as [C, T] over [T, C] memory
    width = window.shape[1]
    src = window[layout.starts, : width - 1]
    tail = x[src.clamp(min=0)] * (src >= 0).unsqueeze(2).to(x.dtype)
    # [S, C, w - 1] over [S, w - 1, C] memory: the layout of vLLM's conv-state cache
    states = tail.contiguous().transpose(1, 2)
    query_start_loc = torch.cat([layout.starts, layout.ends[-1:]]).to(torch.int32)
    slots = torch.arange(layout.num_segments, dtype=torch.int32, device=x.device)
    has_state = layout.parent >= 0
    silu = layer.activation in ("silu", "swish")
    if getattr(layer.conv1d, "_cpu_unpacked_conv_weight", None) is not None:
        # vLLM packed the taps at load time: it then runs the C++ op (AVX-512 BF16 / Arm BF16)
        out = compat.locate("flide", "causal_conv1d_fwd_cpu")(
            x=x.t(), weight=layer.conv1d.weight, bias=layer.conv1d.bias, conv_states=states,
            query_start_loc=query_start_loc, cache_indices=slots, has_initial_state=has_state,
            silu_activation=silu, is_weight_packed=True,
        )  # fmt: skip
    else:
        out = compat.locate("flide", "causal_conv1d_fn_cpu")(
            x=x.t(), weight=_conv_weight(layer), bias=layer.conv1d.bias, conv_states=states,
            query_start_loc=query_start_loc, cache_indices=slots, has_initial_state=has_state,
            activation=layer.activation,
        )  # fmt: skip
    return out.t()


def cpu_gdn_gating(layer, a: torch.Tensor, b: torch.Tensor):
    """``g [T, H]`` fp32 and ``beta [T, H]`` from vLLM's fused CPU gating op."""
    g, beta = compat.locate("flide", "fused_gdn_gating_cpu")(
        A_log=layer.A_log, a=a.contiguous(), b=b.contiguous(), dt_bias=layer.dt_bias
    )
    return g.reshape(a.shape), beta.reshape(b.shape)


def _conv_weight(layer) -> torch.Tensor:
    """The conv taps as ``[C, W]`` (vLLM packs them in place on some CPUs)."""
    weight = getattr(layer.conv1d, "_cpu_unpacked_conv_weight", None)
    if weight is None:
        weight = layer.conv1d.weight
    return weight.reshape(weight.shape[0], -1)


class CpuDeltaRule:
    """vLLM's CPU ``chunk_gated_delta_rule`` op; state ``[N, H, K, V]`` fp32.

    The op takes bf16 q/k/v/beta only (as vLLM's own CPU path feeds it), so
    other dtypes are cast for the call and the output cast back.
    """

    def zero_states(self, num, heads, k_dim, v_dim, device):
        return torch.zeros(num, heads, k_dim, v_dim, dtype=torch.float32, device=device)

    def __call__(self, q, k, v, g, beta, states, cu_seqlens):
        bf16 = [t.to(torch.bfloat16).contiguous() for t in (q, k, v, beta)]
        indices = torch.arange(states.shape[0], dtype=torch.int32, device=q.device)
        out, _ = compat.locate("flide", "chunk_gated_delta_rule_cpu")(
            query=bf16[0], key=bf16[1], value=bf16[2], g=g.float().contiguous(), beta=bf16[3],
            initial_state=states, output_final_state=True, cu_seqlens=cu_seqlens,
            head_first=False, use_qk_l2norm_in_kernel=True, initial_state_indices=indices,
        )  # fmt: skip
        # the op writes each sequence's final state back into its slot
        return out.to(v.dtype), states


class FlaDeltaRule:
    """vLLM's vendored FLA Triton op (GPU); state ``[N, H, V, K]`` fp32. Unverified: no GPU yet."""

    def zero_states(self, num, heads, k_dim, v_dim, device):
        return torch.zeros(num, heads, v_dim, k_dim, dtype=torch.float32, device=device)

    def __call__(self, q, k, v, g, beta, states, cu_seqlens):
        from vllm.third_party.flash_linear_attention.ops import chunk_gated_delta_rule

        return chunk_gated_delta_rule(
            q, k, v, g, beta, initial_state=states, output_final_state=True,
            cu_seqlens=cu_seqlens.long(), use_qk_l2norm_in_kernel=True,
        )  # fmt: skip


def check_supported(model: nn.Module, architecture: str) -> None:
    """Raise :class:`UnsupportedModelError` for what the packed pass cannot compute exactly."""
    if architecture not in SUPPORTED_ARCHITECTURES:
        why = f" ({UNPACKABLE[architecture]})" if architecture in UNPACKABLE else ""
        raise UnsupportedModelError(
            f"Flide cannot pack {architecture}{why}; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    for name, module in model.named_modules():
        if isinstance(module, Attention):
            compat.check_instance("flide", module, "Attention")
        if isinstance(module, QwenGatedDeltaNetAttention):
            compat.check_instance("flide", module, "QwenGatedDeltaNetAttention")
        if isinstance(module, Attention) and module.sliding_window is not None:
            raise UnsupportedModelError(
                f"{architecture}: {name} uses sliding-window attention, which Flide cannot pack"
            )
        if isinstance(module, GatedDeltaNetAttention) and not isinstance(
            module, QwenGatedDeltaNetAttention
        ):
            raise UnsupportedModelError(
                f"{architecture}: {name} is a {type(module).__name__}, which Flide cannot pack"
            )
        weight = getattr(getattr(module, "in_proj_qkvz", None), "weight", None)
        if (
            isinstance(module, QwenGatedDeltaNetAttention)
            and weight is not None
            and weight.device.type == "cpu"
            and weight.dtype != torch.bfloat16
        ):
            raise UnsupportedModelError(
                f"{architecture}: vLLM's CPU Gated DeltaNet ops take bf16 only; serve it with "
                "--dtype bfloat16"
            )


@contextmanager
def _stand_ins(model: nn.Module, layout: PackedLayout) -> Iterator[None]:
    """Swap every attention / GDN module for its packed stand-in; always restore."""
    starts = key_start(layout)
    window: torch.Tensor | None = None
    kernel: DeltaRule = FlaDeltaRule() if layout.input_ids.is_cuda else CpuDeltaRule()
    swaps = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if isinstance(child, Attention):
                swaps.append((parent, name, child, PackedAttention(child, layout, starts)))
            elif isinstance(child, QwenGatedDeltaNetAttention):
                if window is None:
                    window = lineage_window(layout, child.conv_kernel_size)
                swaps.append(
                    (parent, name, child, PackedGatedDeltaNet(child, layout, window, kernel))
                )
    try:
        for parent, name, _, stand_in in swaps:
            parent._modules[name] = stand_in
        yield
    finally:
        for parent, name, original, _ in swaps:
            parent._modules[name] = original


def packed_logprobs(model: nn.Module, vllm_config, batch: PackedBatch) -> torch.Tensor:
    """``[R, V]`` log-softmax of the logits at ``batch.readout_rows`` after one packed pass."""
    device = next(model.parameters()).device
    layout = batch.layout.to(device)
    inner = model.model
    positions = layout.positions
    if vllm_config.model_config.uses_mrope:
        # text only: every M-RoPE channel carries the token's position
        positions = positions.expand(vllm_config.model_config.mrope_num_dims, -1)
    with torch.inference_mode(), set_forward_context(None, vllm_config), _stand_ins(model, layout):
        hidden = model.embed_input_ids(layout.input_ids)
        residual = None
        for layer in inner.layers[inner.start_layer : inner.end_layer]:
            hidden, residual = layer(positions=positions, hidden_states=hidden, residual=residual)
        hidden, _ = inner.norm(hidden, residual)
        logits = model.compute_logits(hidden[batch.readout_rows.to(device)])
    return torch.log_softmax(logits.float(), dim=-1)
