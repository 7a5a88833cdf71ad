"""A minimal Llama decoder in plain torch, with the per-layer KV exposed (no vLLM).

ACCT needs what serving engines hide: the residual stream after layer ``k``,
each layer's keys (before and after RoPE) and values, and a forward over new
tokens against a cache that was *given*, not computed. Batch size is one;
tensors have no batch dimension. Keys and values are ``[kv_heads, tokens,
head_dim]``; keys are post-RoPE at their true positions, exactly what vLLM
stores in its paged cache for the same model.

Loads a Hugging Face Llama folder (``config.json`` + ``*.safetensors``), e.g.
SmolLM2-135M from the ``smollm2`` asset. Computes in the dtype it is loaded in
(fp32 by default).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

KV = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class LlamaShape:
    """The fields of a Llama ``config.json`` the forward needs."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool

    @classmethod
    def from_config(cls, config: dict) -> LlamaShape:
        if config.get("model_type") != "llama":
            raise ValueError(
                f"ACCT supports Llama models, got model_type={config.get('model_type')}"
            )
        rope = config.get("rope_parameters") or {}
        rope_type = rope.get("rope_type", (config.get("rope_scaling") or {}).get("rope_type"))
        if rope_type not in (None, "default"):
            raise ValueError(f"unsupported rope type {rope_type!r} (only default RoPE)")
        heads = config["num_attention_heads"]
        return cls(
            hidden_size=config["hidden_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads", heads),
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            intermediate_size=config["intermediate_size"],
            vocab_size=config["vocab_size"],
            rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        )

    @property
    def kv_width(self) -> int:
        return self.num_kv_heads * self.head_dim


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_normalize(x, self.eps) * self.weight


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class Rope:
    """Llama (NeoX-style, rotate-half) rotary embedding at arbitrary positions."""

    def __init__(self, head_dim: int, theta: float):
        self.inv_freq = 1.0 / theta ** (
            torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
        )

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        freqs = positions.to(torch.float64)[:, None] * self.inv_freq.to(positions.device)[None]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x``: ``[heads, tokens, head_dim]``; ``cos``/``sin``: ``[tokens, head_dim]``."""
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, s: LlamaShape):
        super().__init__()
        self.s = s
        self.q_proj = nn.Linear(s.hidden_size, s.num_heads * s.head_dim, bias=False)
        self.k_proj = nn.Linear(s.hidden_size, s.kv_width, bias=False)
        self.v_proj = nn.Linear(s.hidden_size, s.kv_width, bias=False)
        self.o_proj = nn.Linear(s.num_heads * s.head_dim, s.hidden_size, bias=False)

    def heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return x.view(x.shape[0], n, self.s.head_dim).transpose(0, 1)


class DecoderLayer(nn.Module):
    def __init__(self, s: LlamaShape):
        super().__init__()
        self.self_attn = Attention(s)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.mlp.up_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.mlp.down_proj = nn.Linear(s.intermediate_size, s.hidden_size, bias=False)
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)


@dataclass
class LayerOut:
    hidden: torch.Tensor
    kv: KV
    pre_rope_key: torch.Tensor | None = None


class TorchLlama(nn.Module):
    """Llama decoder whose layers can be run one at a time over a given cache."""

    def __init__(self, shape: LlamaShape):
        super().__init__()
        self.shape = shape
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(shape) for _ in range(shape.num_layers))
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.lm_head = None
        if not shape.tie_word_embeddings:
            self.lm_head = nn.Linear(shape.hidden_size, shape.vocab_size, bias=False)
        self.rope = Rope(shape.head_dim, shape.rope_theta)

    @classmethod
    def from_pretrained(cls, folder: str | Path, dtype: torch.dtype = torch.float32) -> TorchLlama:
        from safetensors.torch import load_file

        folder = Path(folder)
        shape = LlamaShape.from_config(json.loads((folder / "config.json").read_text()))
        model = cls(shape)
        state = {}
        for file in sorted(folder.glob("*.safetensors")):
            for name, tensor in load_file(file).items():
                state[re.sub(r"^model\.", "", name)] = tensor.to(dtype)
        if shape.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        missing, unexpected = model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(f"{folder}: missing weights {missing}, unexpected {unexpected}")
        return model.to(dtype).eval().requires_grad_(False)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rope.cos_sin(positions, self.dtype)

    def layer(
        self,
        index: int,
        hidden: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        past: KV | None = None,
        *,
        keep_pre_rope: bool = False,
        past_bias: torch.Tensor | None = None,
    ) -> LayerOut:
        """Run decoder layer ``index`` over ``hidden`` (``[tokens, hidden]``).

        The new tokens attend to ``past`` (all of it) and causally to each other.
        Returns the layer output and the new tokens' own KV (not concatenated).
        ``past_bias`` (``[kv_heads, past tokens]``) is added to the attention logits
        of the past tokens: ``-inf`` drops a token from one KV head, and its gradient
        at 0 is the first-order effect of deleting it (:mod:`vllm_ext.acct.compress`).
        """
        s, layer = self.shape, self.layers[index]
        attn = layer.self_attn
        x = layer.input_layernorm(hidden)
        q = attn.heads(attn.q_proj(x), s.num_heads)
        k_pre = attn.heads(attn.k_proj(x), s.num_kv_heads)
        v = attn.heads(attn.v_proj(x), s.num_kv_heads)
        cos, sin = cos_sin
        q, k = Rope.apply(q, cos, sin), Rope.apply(k_pre, cos, sin)
        keys, values = (
            (k, v) if past is None else (torch.cat([past[0], k], 1), torch.cat([past[1], v], 1))
        )
        out = attend(q, keys, values, s.num_heads // s.num_kv_heads, past_bias)
        hidden = hidden + attn.o_proj(out.transpose(0, 1).reshape(hidden.shape[0], -1))
        x = layer.post_attention_layernorm(hidden)
        mlp = layer.mlp
        hidden = hidden + mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
        return LayerOut(hidden, (k, v), k_pre if keep_pre_rope else None)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        x = self.norm(hidden)
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return x @ weight.T

    def forward_with_cache(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        past: list[KV] | None = None,
        past_bias: list[torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, list[KV]]:
        """Logits of ``ids`` at ``positions`` over ``past`` (one KV per layer), and their KV."""
        hidden = self.embed(ids)
        cs = self.cos_sin(positions)
        new: list[KV] = []
        for i in range(self.shape.num_layers):
            bias = None if past_bias is None else past_bias[i]
            out = self.layer(i, hidden, cs, None if past is None else past[i], past_bias=bias)
            hidden = out.hidden
            new.append(out.kv)
        return self.logits(hidden), new


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: int,
    past_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal GQA attention of the last ``q.shape[1]`` positions over all of ``k``/``v``.

    ``past_bias``: ``[kv_heads, past]`` added to the logits of the first ``past`` keys.
    """
    if group > 1:
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    n_new, n_all = q.shape[1], k.shape[1]
    mask = torch.ones(n_new, n_all, dtype=torch.bool, device=q.device).tril(n_all - n_new)
    if past_bias is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    bias = torch.zeros(n_new, n_all, dtype=q.dtype, device=q.device).masked_fill(~mask, -math.inf)
    bias = bias.expand(q.shape[0], n_new, n_all)
    past = past_bias.to(q.dtype).repeat_interleave(group, 0)[:, None, :].expand(-1, n_new, -1)
    bias = torch.cat([bias[..., : past.shape[-1]] + past, bias[..., past.shape[-1] :]], -1)
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5 + bias
    return torch.softmax(scores, -1) @ v


def concat_kv(a: KV, b: KV) -> KV:
    return torch.cat([a[0], b[0]], 1), torch.cat([a[1], b[1]], 1)


def slice_kv(kv: KV, start: int, end: int | None = None) -> KV:
    return kv[0][:, start:end], kv[1][:, start:end]
