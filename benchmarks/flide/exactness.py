"""Flide's exactness on random tiny models: Flide, separate vLLM requests and fp32 truth.

For one architecture and a seed: a random tiny configuration (where the
attention layers sit, linear key/value head counts, hidden and head sizes,
dense or MoE MLPs, weight scale), random weights saved in bf16, and random
classification calls (several contexts per call, contexts from a few tokens
to > 4k, questions of very different lengths, one- and multi-token labels).
Every (question, label) log-probability is computed three ways:

- **flide**: the packed pass (``flide_classify`` RPC), passes planned as the
  classifier plans them;
- **vllm**: one vLLM request per ``context + question + label``
  (``prompt_logprobs``), prefix caching off;
- **truth**: a float32 transformers forward of each ``context + question +
  label`` alone, on the same (bf16-stored) weights.

:func:`compare` reports the worst ``|logprob - truth|`` of both, class
agreement with the truth where the truth's margin is not a near-tie, and for
MoE models how often Flide's routing (top-k experts per token and layer)
equals the truth's. Used by ``tests/engine/test_flide_exactness.py`` and
``python -m benchmarks.flide.drift``.
"""

from __future__ import annotations

import gc
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from vllm_ext.flide.batch import Item, pack_items
from vllm_ext.flide.classifier import RPC_METHOD, WORKER_EXTENSION
from vllm_ext.flide.plan import Question, plan_passes

VOCAB = 49152  # SmolLM2's tokenizer, which every tiny model carries
FIRST_ID = 3  # ids below are special tokens
NEAR_TIE = 0.05  # truth margins (nats) below this are ties a rounding may break


@dataclass(frozen=True)
class Arch:
    """One model family: its vLLM architecture and a random tiny config from an rng."""

    name: str
    architecture: str
    make: Callable[[random.Random], tuple[object, dict]]
    hybrid: bool
    moe: bool


def _common(rng: random.Random) -> dict:
    return dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                rms_norm_eps=1e-6, max_position_embeddings=8192,
                tie_word_embeddings=rng.random() < 0.5,
                initializer_range=rng.choice([0.02, 0.05, 0.08]))  # fmt: skip


def _layer_types(rng: random.Random, num_layers: int) -> list[str]:
    """Random placement, at least one Gated DeltaNet layer and one attention layer."""
    while True:
        types = [rng.choice(["linear_attention", "full_attention"]) for _ in range(num_layers)]
        if len(set(types)) == 2:
            return types


def _hybrid_fields(rng: random.Random) -> dict:
    num_layers = rng.choice([2, 3, 4])
    key_heads = rng.choice([1, 2])
    return dict(
        num_hidden_layers=num_layers,
        layer_types=_layer_types(rng, num_layers),
        hidden_size=rng.choice([64, 128, 256]),
        intermediate_size=rng.choice([128, 256]),
        num_attention_heads=rng.choice([2, 4]),
        num_key_value_heads=rng.choice([1, 2]),
        head_dim=rng.choice([64, 128]),
        linear_num_key_heads=key_heads,
        linear_num_value_heads=key_heads * rng.choice([1, 2]),
        # the CPU GDN op takes 128 (it rejects 32)
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
    )


def _moe_fields(rng: random.Random) -> dict:
    experts = rng.choice([4, 8])
    return dict(num_experts=experts, num_experts_per_tok=rng.choice([1, 2]),
                moe_intermediate_size=rng.choice([64, 128]),
                shared_expert_intermediate_size=rng.choice([64, 128]),
                norm_topk_prob=True)  # fmt: skip


def _qwen3_next(rng):
    from transformers import Qwen3NextConfig

    fields = _hybrid_fields(rng) | _moe_fields(rng) | _common(rng)
    # vLLM 0.32's Qwen3-Next never ties lm_head to the embeddings (its lm_head stays
    # uninitialised); Qwen3-Next checkpoints do not tie them
    fields["tie_word_embeddings"] = False
    # some layers with a dense MLP (Qwen3-Next's mlp_only_layers)
    fields["mlp_only_layers"] = [
        i for i in range(fields["num_hidden_layers"]) if rng.random() < 0.3
    ]
    fields["partial_rotary_factor"] = 0.25
    return Qwen3NextConfig(architectures=["Qwen3NextForCausalLM"], **fields), fields


def _rope_mrope(rng, head_dim: int) -> dict:
    rotary = head_dim // 4
    half = rotary // 2
    section = [half - 2 * (half // 3), half // 3, half // 3]
    return {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
            "mrope_section": section, "mrope_interleaved": True}  # fmt: skip


def _qwen3_5(rng):
    from transformers import Qwen3_5TextConfig

    fields = _hybrid_fields(rng) | _common(rng)
    fields["rope_parameters"] = _rope_mrope(rng, fields["head_dim"])
    return Qwen3_5TextConfig(architectures=["Qwen3_5ForCausalLM"], **fields), fields


def _qwen3_5_moe(rng):
    from transformers import Qwen3_5MoeTextConfig

    fields = _hybrid_fields(rng) | _moe_fields(rng) | _common(rng)
    fields.pop("intermediate_size")
    fields.pop("norm_topk_prob")
    fields["rope_parameters"] = _rope_mrope(rng, fields["head_dim"])
    config = Qwen3_5MoeTextConfig(architectures=["Qwen3_5MoeForCausalLM"], **fields)
    return config, fields


def _dense_fields(rng: random.Random) -> dict:
    heads = rng.choice([2, 4, 8])
    return dict(num_hidden_layers=rng.choice([1, 2, 3]), hidden_size=rng.choice([64, 128, 256]),
                intermediate_size=rng.choice([128, 256, 512]), num_attention_heads=heads,
                num_key_value_heads=rng.choice([h for h in (1, 2, heads) if heads % h == 0]),
                head_dim=rng.choice([32, 64, 128]), rope_theta=10000.0) | _common(rng)  # fmt: skip


def _llama(rng):
    from transformers import LlamaConfig

    fields = _dense_fields(rng)
    return LlamaConfig(architectures=["LlamaForCausalLM"], **fields), fields


def _qwen3(rng):
    from transformers import Qwen3Config

    fields = _dense_fields(rng)
    return Qwen3Config(architectures=["Qwen3ForCausalLM"], **fields), fields


ARCHS = {
    arch.name: arch
    for arch in (
        Arch("qwen3-next", "Qwen3NextForCausalLM", _qwen3_next, hybrid=True, moe=True),
        Arch("qwen3.5", "Qwen3_5ForCausalLM", _qwen3_5, hybrid=True, moe=False),
        Arch("qwen3.5-moe", "Qwen3_5MoeForCausalLM", _qwen3_5_moe, hybrid=True, moe=True),
        Arch("llama", "LlamaForCausalLM", _llama, hybrid=False, moe=False),
        Arch("qwen3", "Qwen3ForCausalLM", _qwen3, hybrid=False, moe=False),
    )
}


def build_model(arch: Arch, seed: int, out: Path) -> dict:
    """Save a random tiny ``arch`` model (bf16 weights, SmolLM2 tokenizer) to ``out``."""
    from vllm_ext.assets.models import _save_random_model

    config, fields = arch.make(random.Random(seed))
    _save_random_model(out, config, seed=seed)
    return fields


@dataclass
class Call:
    """One classification call: ``items`` as ``[(context, [question])]`` token ids, and labels."""

    items: list[tuple[list[int], list[list[int]]]]
    labels: list[list[int]]


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(FIRST_ID, VOCAB) for _ in range(n)]


def random_calls(seed: int, short: int, long_context: int = 0) -> list[Call]:
    """``short`` calls with contexts of 2-400 tokens, plus one with a ``long_context`` one."""
    rng = random.Random(seed)
    calls = []
    for n in range(short + (1 if long_context else 0)):
        long = n == short
        # the long call: two one-token labels (each label is a separate request for vLLM)
        num_labels = 2 if long else rng.choice([2, 3, 4])
        # every other call has multi-token labels (up to 3 tokens)
        multi = n % 2 == 1 and not long
        widths = [rng.choice([1, 2, 3]) if multi else 1 for _ in range(num_labels)]
        labels: list[list[int]] = []
        while len(labels) < num_labels:
            label = _ids(rng, widths[len(labels)])
            if label not in labels:
                labels.append(label)
        if not long:
            items = []
            for _ in range(rng.choice([1, 2, 3])):
                context = _ids(rng, int(2 * 200 ** rng.random()))
                lengths = [rng.choice([1, rng.randint(2, 8), rng.randint(20, 60)])
                           for _ in range(rng.choice([1, 2, 4]))]  # fmt: skip
                items.append((context, [_ids(rng, q) for q in lengths]))
        else:
            context = _ids(rng, long_context + rng.randrange(64))
            items = [(context, [_ids(rng, rng.randint(1, 30)) for _ in range(2)])]
        calls.append(Call(items, labels))
    return calls


def flide_logprobs(llm, call: Call, budget: int) -> tuple[list[list[float]], list]:
    """``[Q][L]`` label log-probabilities from Flide, and the passes (items, questions) run."""
    contexts = [tuple(c) for c, _ in call.items]
    questions = [Question(i, f"{i}.{j}", tuple(q)) for i, (_, qs) in enumerate(call.items)
                 for j, q in enumerate(qs)]  # fmt: skip
    labels = [tuple(x) for x in call.labels]
    out: dict[str, list[float]] = {}
    passes = plan_passes(contexts, questions, labels, budget)
    for packed in passes:
        payload = {"items": packed.items, "labels": call.labels}
        rows = llm.collective_rpc(RPC_METHOD, args=(payload,))[0]
        out |= {q.id: row for q, row in zip(packed.questions, rows, strict=True)}
    return [out[q.id] for q in questions], passes


def vllm_logprobs(llm, call: Call) -> list[list[float]]:
    """``[Q][L]`` from one vLLM request per ``context + question + label``."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts, spans = [], []
    for context, questions in call.items:
        for question in questions:
            for label in call.labels:
                ids = context + question + label
                prompts.append(TokensPrompt(prompt_token_ids=ids))
                spans.append((len(ids) - len(label), label))
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    # long prompts one at a time: prompt logprobs hold [tokens, vocab] per request
    batches, current = [], []
    for prompt in prompts:
        current.append(prompt)
        if sum(len(p["prompt_token_ids"]) for p in current) > 2048:
            batches.append(current)
            current = []
    batches += [current] if current else []
    outs = [out for batch in batches for out in llm.generate(batch, params, use_tqdm=False)]
    flat = [sum(out.prompt_logprobs[start + m][tok].logprob for m, tok in enumerate(label))
            for out, (start, label) in zip(outs, spans, strict=True)]  # fmt: skip
    width = len(call.labels)
    return [flat[i : i + width] for i in range(0, len(flat), width)]


@dataclass
class Truth:
    logprobs: list[list[float]]
    # per question: {moe layer: [T, k] sorted top-k experts} over context + question
    routing: list[dict[int, torch.Tensor]] = field(default_factory=list)


def load_truth_model(path: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()


def _router_modules(model) -> dict[int, torch.nn.Module]:
    """transformers' MoE routers by layer index (their output's third item is the top-k)."""
    out = {}
    for n, layer in enumerate(model.model.layers):
        gate = getattr(getattr(layer, "mlp", None), "gate", None)
        if gate is not None and hasattr(gate, "top_k"):
            out[n] = gate
    return out


@torch.inference_mode()
def truth_logprobs(model, call: Call) -> Truth:
    """fp32 transformers forward of each ``context + question + label`` alone."""
    routers = _router_modules(model)
    seen: dict[int, torch.Tensor] = {}
    hooks = [gate.register_forward_hook(lambda m, i, o, n=n: seen.__setitem__(n, o[2]))
             for n, gate in routers.items()]  # fmt: skip
    truth = Truth([])
    try:
        for context, questions in call.items:
            for question in questions:
                prefix = context + question
                row, cache = [], {}
                for label in call.labels:
                    feed = tuple(prefix + label[:-1])
                    if feed not in cache:
                        # only the rows that predict label tokens: [T, V] at 4k tokens is GBs
                        logits = model(torch.tensor([feed]), logits_to_keep=len(label)).logits
                        cache[feed] = torch.log_softmax(logits[0].double(), dim=-1)
                        if not row and routers:
                            n = len(prefix)
                            truth.routing.append({k: v[:n].sort(-1).values
                                                  for k, v in seen.items()})  # fmt: skip
                    logp = cache[feed]
                    row.append(float(sum(logp[m, t] for m, t in enumerate(label))))
                truth.logprobs.append(row)
    finally:
        for hook in hooks:
            hook.remove()
    return truth


def install_router_probe(llm, on: bool) -> None:
    """Record (or stop recording) vLLM's top-k experts per token in every MoE layer."""

    def probe(worker, on=on):
        model = worker.model_runner.get_model()
        k = worker.model_runner.vllm_config.model_config.hf_text_config.num_experts_per_tok
        for hook in getattr(worker, "_flide_probe_hooks", []):
            hook.remove()
        worker._flide_probe_hooks, worker._flide_routing = [], {}
        if not on:
            return
        for n, layer in enumerate(model.model.layers):
            mlp = getattr(layer, "mlp", None)
            gate = getattr(mlp, "gate", None)
            if gate is None or getattr(mlp, "experts", None) is None:
                continue

            def hook(module, args, output, n=n, k=k):
                logits = output[0] if isinstance(output, tuple) else output
                top = logits.float().topk(k, dim=-1).indices.sort(-1).values.cpu()
                worker._flide_routing.setdefault(n, []).append(top)

            worker._flide_probe_hooks.append(gate.register_forward_hook(hook))

    llm.collective_rpc(probe)


def collect_routing(llm) -> dict[int, list[torch.Tensor]]:
    return llm.collective_rpc(lambda worker: dict(getattr(worker, "_flide_routing", {})))[0]


def routing_agreement(passes, call: Call, routing, truth: Truth) -> tuple[int, int]:
    """(agreeing, total) (token, MoE layer) top-k sets, Flide vs truth, context + question."""
    ids = [f"{i}.{j}" for i, (_, qs) in enumerate(call.items) for j in range(len(qs))]
    truth_of = dict(zip(ids, truth.routing, strict=True))
    conts = sum(len(label) > 1 for label in call.labels)
    agree = total = 0
    for p, packed in enumerate(passes):
        items = [Item(tuple(c), tuple(map(tuple, qs))) for c, qs in packed.items]
        layout = pack_items(items, call.labels).layout
        questions = iter(packed.questions)
        seg = 0  # pack_items' order: context, then each question and its label continuations
        for _, qs in packed.items:
            ctx_seg, seg = seg, seg + 1
            for _ in qs:
                question, q_seg, seg = next(questions), seg, seg + 1 + conts
                rows = torch.cat([torch.arange(int(layout.starts[s]), int(layout.ends[s]))
                                  for s in (ctx_seg, q_seg)])  # fmt: skip
                for layer, want in truth_of[question.id].items():
                    same = (routing[layer][p][rows] == want).all(-1)
                    agree += int(same.sum())
                    total += same.numel()
    return agree, total


def _drift(row, truth_row) -> float:
    """Largest ``|a - b|`` over a row; NaN counts as infinitely far."""
    out = 0.0
    for a, b in zip(row, truth_row, strict=True):
        gap = abs(a - b)
        out = math.inf if math.isnan(gap) else max(out, gap)
        if out == math.inf:
            break
    return out


def compare(flide, vllm, truth: Truth, dtype: str, tolerance: float) -> dict:
    """Worst drifts from the truth, and class disagreements with it that rounding cannot explain.

    A row's truth is decided when its margin exceeds twice the larger of
    ``tolerance`` and vLLM's own drift on that row (a margin vLLM's rounding
    can overturn is a near-tie); Flide must pick the truth's class there.
    """
    worst_flide = worst_vllm = 0.0
    decided, flide_wrong, vllm_agree = 0, [], 0
    for n, (f_row, v_row, t_row) in enumerate(zip(flide, vllm, truth.logprobs, strict=True)):
        f_drift, v_drift = _drift(f_row, t_row), _drift(v_row, t_row)
        worst_flide, worst_vllm = max(worst_flide, f_drift), max(worst_vllm, v_drift)
        ranked = sorted(t_row, reverse=True)
        if ranked[0] - ranked[1] > 2 * max(tolerance, v_drift, NEAR_TIE / 2):
            decided += 1
            best = t_row.index(ranked[0])
            if max(range(len(f_row)), key=f_row.__getitem__) != best:
                flide_wrong.append(n)
            vllm_agree += max(range(len(v_row)), key=v_row.__getitem__) == best
    return {"dtype": dtype, "rows": len(flide), "worst_flide_vs_truth": worst_flide,
            "worst_vllm_vs_truth": worst_vllm, "decided_rows": decided,
            "flide_class_disagreements": flide_wrong,
            "vllm_class_agreement": vllm_agree}  # fmt: skip


def merge(reports: list[dict]) -> dict:
    """One report over several calls' :func:`compare` reports (row indices dropped)."""
    return {"dtype": reports[0]["dtype"], "rows": sum(r["rows"] for r in reports),
            "worst_flide_vs_truth": max(r["worst_flide_vs_truth"] for r in reports),
            "worst_vllm_vs_truth": max(r["worst_vllm_vs_truth"] for r in reports),
            "decided_rows": sum(r["decided_rows"] for r in reports),
            "flide_class_disagreements": sum(len(r["flide_class_disagreements"]) for r in reports),
            "vllm_class_agreement": sum(r["vllm_class_agreement"] for r in reports)}  # fmt: skip


def run_calls(llm, truth_model, calls: list[Call], dtype: str, tolerance: float, budget: int,
              moe: bool) -> tuple[dict, list[dict]]:  # fmt: skip
    """Every call three ways; the merged report (with MoE routing agreement) and each call's."""
    reports, agree, total = [], 0, 0
    for call in calls:
        if moe:
            install_router_probe(llm, True)
        flide, passes = flide_logprobs(llm, call, budget)
        if moe:
            routing = collect_routing(llm)
            install_router_probe(llm, False)
        truth = truth_logprobs(truth_model, call)
        report = compare(flide, vllm_logprobs(llm, call), truth, dtype, tolerance)
        if moe:
            a, t = routing_agreement(passes, call, routing, truth)
            agree, total = agree + a, total + t
            report["routing_agreement"] = a / t
        report["context_tokens"] = [len(c) for c, _ in call.items]
        report["label_tokens"] = [len(label) for label in call.labels]
        reports.append(report)
    merged = merge(reports)
    if moe:
        merged["routing_agreement"] = agree / total
    return merged, reports


def engine(path: Path, dtype: str, max_model_len: int, **kwargs):
    from vllm import LLM

    gc.collect()
    return LLM(model=str(path), dtype=dtype, worker_extension_cls=WORKER_EXTENSION,
               enforce_eager=True, kv_cache_memory_bytes=256 << 20, seed=0,
               max_model_len=max_model_len, enable_prefix_caching=False,
               max_num_batched_tokens=2048, **kwargs)  # fmt: skip


def close(llm) -> None:
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    del llm
    gc.collect()
    cleanup_dist_env_and_memory()
