"""LEAP's worker-side cost on a GPU: probe hook, one-copy collection and CPU head vs step time.

vLLM cannot run on the GPU machine lent to this project (no network there; vLLM
0.32's CUDA wheel is 326 MB and needs a CUDA torch 2.13, far over what the
device tool carries), so this measures the parts LEAP adds to a model step on
SmolLM2-135M-Instruct's exact shape without vLLM: transformers' Llama built from
the model's config.json with random bf16 weights (timings do not depend on the
weight values) and LEAP's own ``ProbeState`` (hook, buffer, ``collect``) and
``LinearLengthModel`` (predict, RLS update).

Steps: a prefill step of ``P`` prompts packed into ``T`` tokens (every prompt
ends in it: one prediction each) and decode steps of ``B`` single tokens with
staggered output lengths, so one request in ``refine_every`` is due a
refinement vector. Decode
steps carry no KV history, so their step time is a lower bound and the share
of step time an upper bound. Timed with CUDA events, medians over repeats:
forward without / with the hook (eager and replayed from a CUDA graph), the
hook alone, ``collect`` (row gather + one device-to-host copy, which
synchronises; and deferred, LEAP's default on CUDA since session 15: a
non-blocking copy to pinned memory, delivered a step late) and the scheduler
side (``LeapRuntime``: one batched prediction of the step's prompts, the due
refinements); LEAP's share of a step is (hook + collect + scheduler side) /
forward, with the synchronising collect (``leap_share_graph_pct``, the
headline) and the deferred one. An RLS update (once per finished
request, on a background thread off the step when the engine has an
accelerator) is timed on its own.
Correctness: after replaying the captured graph on new inputs (and, with
``--compile``, after a ``torch.compile``'d forward), the probe buffer holds
layer L's output of those inputs (vs eager ``output_hidden_states``).

``python -m benchmarks.leap.gpu_probe --config CONFIG_JSON --out DIR``
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from vllm_ext.bench import (
    OUT_DIR,
    BenchResult,
    collect_fingerprint,
    load_result,
    make_headline,
    write_result,
)
from vllm_ext.common.counters import Counters
from vllm_ext.leap.config import LeapConfig
from vllm_ext.leap.predictor import LinearLengthModel
from vllm_ext.leap.probe import ProbeState
from vllm_ext.leap.runtime import COUNTERS, LeapRuntime

NAME = "leap_gpu_probe"
REFINE_EVERY = 32


def _flat_hook(probe: ProbeState, hidden_size: int):
    # vLLM's runner feeds [tokens, hidden]; transformers' layers see [batch, seq, hidden]
    def hook(module, args, output):
        state = output[0] if isinstance(output, tuple) else output
        probe.hook(module, args, state.reshape(-1, hidden_size))

    return hook


def _runner(num_reqs: int, query_lens: list[int], computed: list[int], prompts: list[int]):
    """The slice of vLLM's V1 runner ``ProbeState.collect`` reads (vLLM does not run here)."""
    starts = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int64)
    batch = SimpleNamespace(
        num_reqs=num_reqs,
        req_ids=[f"r{i}" for i in range(num_reqs)],
        num_computed_tokens_cpu=np.array(computed),
        num_prompt_tokens=np.array(prompts),
    )
    starts_cpu = SimpleNamespace(cpu=torch.tensor(starts))
    return SimpleNamespace(input_batch=batch, query_start_loc=starts_cpu)


def _cuda_ms(fn, repeats: int) -> float:
    if not torch.cuda.is_available():
        return _wall_ms(fn, repeats)  # the CPU smoke run
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _wall_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _graph(fn):
    """``fn`` captured in a CUDA graph (after a warm-up on a side stream)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def _try_graph(forward, repeats: int):
    """(graph, replay ms), or (None, reason) where capture is impossible (CPU, or a sync in fn)."""
    if not torch.cuda.is_available():
        return None, "no CUDA"
    try:
        graph = _graph(forward)
    except RuntimeError as exc:  # e.g. a host sync inside the model's forward
        torch.cuda.synchronize()
        return None, f"capture failed: {str(exc)[:200]}"
    return graph, _cuda_ms(graph.replay, repeats)


def measure_step(model, probe, layer, shape, runner, runtime, repeats) -> dict:
    """Timings of one step shape ``(batch, seq)`` with and without LEAP's hook."""
    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    device = next(model.parameters()).device
    ids = torch.randint(0, vocab, shape, device=device)
    forward = torch.no_grad()(lambda: model(input_ids=ids, use_cache=False))
    step_ms = _cuda_ms(forward, repeats)
    _, graph_ms = _try_graph(forward, repeats)
    handle = model.model.layers[layer].register_forward_hook(_flat_hook(probe, hidden))
    try:
        probe_ms = _cuda_ms(forward, repeats)
        graph, graph_probe_ms = _try_graph(forward, repeats)
        # the buffer after a step on new inputs (replayed from the graph where captured)
        ids.copy_(torch.randint(0, vocab, shape, device=device))
        graph.replay() if graph is not None else forward()
        captured = probe.buffer[: ids.numel()].clone()
        with torch.no_grad():
            eager = model(input_ids=ids, use_cache=False, output_hidden_states=True)
        expected = eager.hidden_states[layer + 1].reshape(-1, hidden).float()
        max_err = (captured - expected).abs().max().item()
        # the hook alone (copy of the step's [tokens, hidden] state into the buffer)
        state = expected.to(torch.bfloat16)
        hook_ms = _cuda_ms(lambda: probe.hook(None, None, state), repeats)
        probe.runner = runner
        collected = {}

        def collect():
            collected["out"] = probe.collect()

        collect_ms = _wall_ms(collect, repeats)
        # LEAP's default on CUDA: a non-blocking copy, the vectors delivered a step late
        probe.deferred = True
        try:
            collect_deferred_ms = _wall_ms(probe.collect, repeats)
        finally:
            probe.deferred = False
    finally:
        handle.remove()
    prompt_vecs, decode_vecs = collected["out"]
    # the scheduler side: one batched prediction for the step's prompts, one
    # refinement per due decode vector (entries exist from their prefill)
    for req_id, (_, vector) in decode_vecs.items():
        runtime.on_probe(req_id, vector)

    def host():  # what LeapConnector.deliver_probes does with one step's metadata
        runtime.on_probes(prompt_vecs)
        runtime.on_decode_probes(decode_vecs)

    predict_ms = _wall_ms(host, repeats)
    X = np.asarray(list(prompt_vecs.values()) + [v for _, v in decode_vecs.values()])
    rls = copy.deepcopy(runtime.model)
    rls_ms = _wall_ms(lambda: rls.rls_update(X[0], 100.0, 0.999), repeats)
    leap_ms = hook_ms + collect_ms + predict_ms
    row = {
        "tokens": int(ids.numel()),
        "vectors": len(X),
        "step_ms": step_ms,
        "step_probe_ms": probe_ms,
        "hook_ms": hook_ms,
        "collect_ms": collect_ms,
        "collect_deferred_ms": collect_deferred_ms,
        "predict_ms": predict_ms,
        "predict_ms_per_vector": predict_ms / max(len(X), 1),
        "rls_update_ms": rls_ms,
        "leap_share_eager_pct": 100 * leap_ms / step_ms,
        "probe_buffer_max_abs_err": max_err,
    }
    if graph is None:
        row["graph"] = graph_probe_ms  # why there is none
    else:
        row |= {
            "graph_step_ms": graph_ms,
            "graph_step_probe_ms": graph_probe_ms,
            "leap_share_graph_pct": 100 * leap_ms / graph_ms,
            "leap_share_graph_deferred_pct": 100
            * (leap_ms - collect_ms + collect_deferred_ms)
            / graph_ms,
        }
    return row


def compiled_probe_check(model, probe, layer: int, tokens: int) -> dict | str:
    """The buffer after a torch.compile'd forward (hook installed first) vs layer L's output.

    ``stale_max_abs_err``: the same comparison before the second call, i.e. what a
    hook that did not fire would leave: the check is only informative if
    ``max_abs_err`` is far below it.
    """
    hidden, vocab = model.config.hidden_size, model.config.vocab_size
    handle = model.model.layers[layer].register_forward_hook(_flat_hook(probe, hidden))
    try:
        compiled = torch.compile(model)
        ids = torch.randint(0, vocab, (1, tokens), device="cuda")
        with torch.no_grad():
            compiled(input_ids=ids, use_cache=False)  # compiles
            ids.copy_(torch.randint(0, vocab, (1, tokens), device="cuda"))
            eager = model(input_ids=ids, use_cache=False, output_hidden_states=True)
            expected = eager.hidden_states[layer + 1].reshape(-1, hidden).float()
            probe.buffer[:tokens].copy_(probe.buffer[:tokens] * 0 + 1e4)  # poison: must change
            stale = (probe.buffer[:tokens] - expected).abs().max().item()
            compiled(input_ids=ids, use_cache=False)
            err = (probe.buffer[:tokens] - expected).abs().max().item()
        return {
            "max_abs_err": err,
            "stale_max_abs_err": stale,
            "max_abs_value": expected.abs().max().item(),
        }
    except Exception as exc:  # report, do not lose the timings already written
        return f"failed: {type(exc).__name__}: {str(exc)[:200]}"
    finally:
        handle.remove()


def build(config_path: Path, device: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig.from_dict(json.loads(config_path.read_text()))
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device, torch.bfloat16).eval()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, help="SmolLM2 config.json")
    parser.add_argument("--out", default=OUT_DIR)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--prefill", default="8x256,32x64", help="PROMPTSxTOKENS steps")
    parser.add_argument("--decode", default="8,64,256", help="decode batch sizes")
    parser.add_argument("--cpu", action="store_true", help="smoke run on CPU (no graphs)")
    parser.add_argument("--compile", action="store_true", help="also check the hook compiled")
    parser.add_argument("--rerender", type=Path, help="rewrite a saved result JSON and exit")
    args = parser.parse_args(argv)
    if args.rerender:
        rerender(args.rerender, args.out)
        return 0
    if args.config is None:
        parser.error("--config is required")
    if not args.cpu and not torch.cuda.is_available():
        parser.error("needs a CUDA device (or --cpu for a smoke run)")
    device = "cpu" if args.cpu else "cuda"
    model = build(args.config, device)
    hidden = model.config.hidden_size
    layer = model.config.num_hidden_layers // 2  # LEAP's default probe layer
    max_tokens = max(p * t for p, t in _pairs(args.prefill))
    max_tokens = max(max_tokens, *(int(b) for b in args.decode.split(",")))
    probe = ProbeState(layer, "last", hidden, max_tokens, refine_every=REFINE_EVERY)
    probe.buffer = torch.zeros(max_tokens, hidden, dtype=torch.float32, device=device)
    runtime = _runtime(hidden, Path(args.out))
    variants = {}
    for prompts, tokens in _pairs(args.prefill):
        runner = _runner(prompts, [tokens] * prompts, [0] * prompts, [tokens] * prompts)
        variants[f"prefill_{prompts}x{tokens}"] = measure_step(
            model, probe, layer, (1, prompts * tokens), runner, runtime, args.repeats
        )
    for batch in (int(b) for b in args.decode.split(",")):
        # staggered output lengths: one request in refine_every is due a vector
        computed = [100 + REFINE_EVERY - 1 + i % REFINE_EVERY for i in range(batch)]
        runner = _runner(batch, [1] * batch, computed, [100] * batch)
        variants[f"decode_{batch}"] = measure_step(
            model, probe, layer, (batch, 1), runner, runtime, args.repeats
        )
    head = headline(variants)
    result = BenchResult(
        name=NAME,
        description=__doc__.split("\n\n")[0],
        variants=variants,
        headline=head,
        fingerprint=collect_fingerprint(),
        plot_metric=head["metric"],
        config={
            "model": "SmolLM2-135M-Instruct shape (random bf16 weights), transformers eager",
            "probe_layer": layer,
            "refine_every": REFINE_EVERY,
            "repeats": args.repeats,
            "vllm": "not run: the lent GPU machine has no network and vLLM's CUDA wheel "
            "plus torch 2.13 exceed what the device tool carries",
        },
    )
    write_result(result, args.out)
    if args.compile and device == "cuda":
        result.config["compiled_probe"] = compiled_probe_check(model, probe, layer, 512)
        write_result(result, args.out)
    sys.stdout.write(json.dumps({"variants": variants, "config": result.config}, indent=1) + "\n")
    return 0


def headline(variants: dict) -> dict:
    """The worst step shape's LEAP share of a CUDA-graph step (vLLM's decode path on a
    GPU; eager steps of transformers are launch-bound, so their share flatters LEAP)."""
    metric = "leap_share_graph_pct"
    if not all(metric in v for v in variants.values()):
        metric = "leap_share_eager_pct"  # no graphs (CPU smoke run)
    worst = max(v[metric] for v in variants.values())
    return make_headline(
        metric, worst, 1.0, "target (1% of step time)", higher_is_better=False,
        target="LEAP's hook + collect + scheduler side < 1% of step time (worst step shape)",
    )  # fmt: skip


def rerender(path: Path, out: str) -> None:
    """Write a saved result again with this module's headline (no GPU needed)."""
    result = load_result(path)
    result.headline = headline(result.variants)
    result.plot_metric = result.headline["metric"]
    write_result(result, out)


def _runtime(hidden: int, folder: Path) -> LeapRuntime:
    """LEAP's scheduler-side runtime with a prefill head and a refinement head (random fits)."""
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, dim in (("head", hidden), ("refine", hidden + 2)):
        X, lengths = rng.normal(size=(4 * dim, dim)), rng.integers(1, 500, 4 * dim)
        paths[name] = folder / f"gpu_probe_{name}.npz"
        LinearLengthModel.fit_ridge(X, lengths).save(paths[name])
    config = LeapConfig(
        weights_path=str(paths["head"]),
        refine_weights_path=str(paths["refine"]),
        refine_every=REFINE_EVERY,
    )
    return LeapRuntime(config, Counters("leap", COUNTERS), hidden_size=hidden)


def _pairs(spec: str) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in item.split("x")) for item in spec.split(",")]


if __name__ == "__main__":
    sys.exit(main())
