"""Held-out ShareGPT perplexity of SmolLM2-135M quantized at equal bits: RTN, layer-wise VQ, TVQ.

Every variant quantizes the same 90 MLP linears (attention and embeddings stay
bf16), is scored on the same held-out tokens (conversations 12k+, never used for
calibration or training; ``vllm_ext.tvq.data``) by a torch fp32 forward, and its
bits per weight count codebooks, scales and zero points:

- ``bf16``: the unquantized model (the SmolLM2 asset is dequantized from a
  4-bit GGUF, so it already sits on a 4-bit grid: 4-bit numbers flatter RTN);
- ``rtn<b>_row`` / ``rtn<b>_g128``: asymmetric round-to-nearest with one bf16
  scale and zero per row (equal bits to VQ) / per 128 weights (``--rtn-groups``);
- ``vq<b>_init``: layer-wise VQ, activation-weighted k-means (the TVQ init);
- ``vq<b>_layerwise`` (headline width only): that init plus per-layer output
  matching of codebook and scales against the calibration Hessian (AQLM-style,
  no end-to-end training);
- ``tvq<b>``: TVQ trained from ``vq<b>_init`` (STE latents, re-lookup, logit
  and block KD) for ``--steps`` steps, with held-out perplexity every
  ``--eval-every`` steps (the recovery curve, the plot).

VQ formats: 4 bits d=2,K=256; 3 bits d=2,K=64; 2 bits d=4,K=256.
Headline: TVQ vs the better layer-wise VQ at ``--headline-bits``, ratio
TVQ/VQ perplexity (target <= 1/1.2). Perplexity is deterministic (seeded
init and training, fixed tokens): one round is the measurement.
``python -m benchmarks.tvq.quality [--steps 100] [--bits 4,3,2]``
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import shutil
import time
from pathlib import Path

import torch

from vllm_ext.bench import BenchResult, collect_fingerprint, headline_from_rounds, write_result
from vllm_ext.tvq import baselines, data, train
from vllm_ext.tvq.codebook import bits_per_weight
from vllm_ext.tvq.qat import VQLinear

FORMATS = {4: (2, 256), 3: (2, 64), 2: (4, 256)}


def _vq_bits(model) -> float:
    vq = [m for m in model.modules() if isinstance(m, VQLinear)]
    total = sum(m.weight.numel() for m in vq)
    return (
        sum(
            bits_per_weight(*m.weight.shape, m.vec_dim, m.codebook.shape[0]) * m.weight.numel()
            for m in vq
        )
        / total
    )


def _rtn_bits(model, bits: int, group: int | None) -> float:
    linears = [m for n, m in model.named_modules() if n.endswith(("gate_proj", "up_proj",
                                                                  "down_proj"))]  # fmt: skip
    total = sum(m.weight.numel() for m in linears)
    return sum(baselines.rtn_bits_per_weight(bits, group or m.weight.shape[1]) * m.weight.numel()
               for m in linears) / total  # fmt: skip


def _refine(student, teacher, calib, steps: int, log) -> None:
    names = [n for n, m in student.named_modules() if isinstance(m, VQLinear)]
    hessians = baselines.input_hessians(teacher, calib, names)
    modules = dict(student.named_modules())
    gains = []
    for name in names:
        before, after = baselines.refine_layerwise(modules[name], hessians[name], steps)
        gains.append(after / max(before, 1e-12))
    log(f"layer-wise refinement: output error x{sum(gains) / len(gains):.3f} on average")


def run(args) -> BenchResult:
    from vllm_ext.tvq.cli import _base, _teacher

    torch.set_num_threads(args.threads)
    start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - start:7.0f} s] {msg}", flush=True)

    base = _base(args.base)
    teacher, tok = _teacher(base)
    for p in teacher.parameters():
        p.requires_grad_(False)
    held_out = data.token_chunks(tok, args.eval_chunks, 512, held_out=True)
    variants: dict[str, dict] = {"bf16": {"ppl": train.perplexity(teacher, held_out), "bits": 16}}
    log(f"bf16 {variants['bf16']}")
    bits_list = [int(b) for b in args.bits.split(",")]
    rtn_bits = [int(b) for b in (args.rtn_bits or args.bits).split(",")]
    for bits in rtn_bits:
        for group in [None if g == "row" else int(g) for g in args.rtn_groups.split(",")]:
            model = copy.deepcopy(teacher)
            baselines.apply_rtn(model, bits, group)
            name = f"rtn{bits}_{'row' if group is None else f'g{group}'}"
            variants[name] = {"ppl": train.perplexity(model, held_out),
                              "bits": _rtn_bits(model, bits, group)}  # fmt: skip
            log(f"{name} {variants[name]}")
    series: dict[str, list[dict]] = {}
    curve_cfg = {}
    for bits in bits_list:
        dim, k = FORMATS[bits]
        settings = train.TrainSettings(
            vec_dim=dim, num_codewords=k, steps=args.steps, batch=args.batch,
            seq_len=args.seq_len, lr=args.lr, codebook_lr=args.codebook_lr,
            relookup_every=args.relookup_every, calib_chunks=args.calib_chunks,
            save_every=max(args.steps, 1),
        )  # fmt: skip
        torch.manual_seed(settings.seed)
        calib = data.token_chunks(tok, settings.calib_chunks, settings.seq_len, held_out=False)
        student = train.init_student(teacher, settings, calib)
        init = {"ppl": train.perplexity(student, held_out), "bits": _vq_bits(student),
                "vec_dim": dim, "num_codewords": k}  # fmt: skip
        variants[f"vq{bits}_init"] = init
        log(f"vq{bits}_init {init}")
        if bits == args.headline_bits and args.steps:
            trained = copy.deepcopy(student)
            chunks = data.token_chunks(tok, 256, settings.seq_len, held_out=False)
            out = args.work / f"tvq{bits}"
            shutil.rmtree(out, ignore_errors=True)  # train() would resume a stale state.pt
            curve = train.train(teacher, trained, chunks, settings, out, held_out, args.eval_every)
            # the curve's last point is the trained model when --eval-every divides --steps
            final = curve[-1].get("ppl") or train.perplexity(trained, held_out)
            row = {**init, "ppl": final, "steps": args.steps, "tokens": curve[-1]["tokens"]}
            variants[f"tvq{bits}"] = row
            log(f"tvq{bits} {row}")
            points = [{"tokens": 0, "ppl": init["ppl"]}]
            points += [{"tokens": r["tokens"], "ppl": r["ppl"]} for r in curve if "ppl" in r]
            if points[-1]["tokens"] != row["tokens"]:
                points.append({"tokens": row["tokens"], "ppl": row["ppl"]})
            series[f"tvq{bits}"] = points
            curve_cfg = {"curve": curve, "settings": dataclasses.asdict(settings)}
            if args.export:
                from vllm_ext.tvq.export import export
                from vllm_ext.tvq.format import QuantFormat

                export(trained, base, out / "ckpt", QuantFormat(dim, k))
            del trained
        if bits != args.headline_bits:
            continue  # the refinement costs minutes per width: only at the headline's
        _refine(student, teacher, calib, args.refine_steps, log)
        variants[f"vq{bits}_layerwise"] = {**init, "ppl": train.perplexity(student, held_out)}
        log(f"vq{bits}_layerwise {variants[f'vq{bits}_layerwise']}")
    hb = args.headline_bits
    last = variants[f"tvq{hb}"]["tokens"]
    for name in (f"vq{hb}_init", f"vq{hb}_layerwise"):
        flat = variants[name]["ppl"]  # no training: a flat line beside the curve
        series[name] = [{"tokens": 0, "ppl": flat}, {"tokens": last, "ppl": flat}]
    best_vq = min((f"vq{hb}_init", f"vq{hb}_layerwise"), key=lambda n: variants[n]["ppl"])
    headline = headline_from_rounds(
        f"held-out ShareGPT perplexity of {args.base}, MLPs at {variants[best_vq]['bits']:.2f} "
        f"bits/weight: TVQ ({variants[f'tvq{hb}']['tokens']} training tokens) vs layer-wise VQ",
        [variants[f"tvq{hb}"]["ppl"]],
        [variants[best_vq]["ppl"]],
        best_vq,
        higher_is_better=False,
        target="ratio <= 1/1.2 (layer-wise VQ / TVQ >= 1.2)",
    )
    return BenchResult(
        name=args.name,
        description=__doc__.strip().splitlines()[0],
        variants=variants,
        headline=headline,
        fingerprint=collect_fingerprint(),
        config={
            "bits": bits_list,
            "formats": {b: FORMATS[b] for b in bits_list},
            "steps": args.steps,
            "batch": args.batch,
            "seq_len": args.seq_len,
            "eval_chunks": args.eval_chunks,
            "eval_seq_len": 512,
            "calib_chunks": args.calib_chunks,
            "refine_steps": args.refine_steps,
            "lr": args.lr,
            "codebook_lr": args.codebook_lr,
            "relookup_every": args.relookup_every,
            "threads": args.threads,
            "wall_s": time.perf_counter() - start,
            **curve_cfg,
        },  # fmt: skip
        series=series,
        sweep_axis="tokens",
        plot_metric="ppl",
    )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default="smollm2")
    p.add_argument("--bits", default="4,3,2")
    p.add_argument("--rtn-bits", default=None, help="RTN widths (default: --bits)")
    p.add_argument("--headline-bits", type=int, default=3)
    p.add_argument("--rtn-groups", default="row,128", help="RTN scale groups: row and/or sizes")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--codebook-lr", type=float, default=1e-4)
    p.add_argument("--relookup-every", type=int, default=5)
    p.add_argument("--calib-chunks", type=int, default=4)
    p.add_argument("--eval-chunks", type=int, default=4)
    p.add_argument("--refine-steps", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--export", action="store_true", help="also write the trained checkpoint")
    p.add_argument("--work", type=Path, default=Path("benchmarks/out/tvq_work"))
    p.add_argument("--name", default="tvq")
    p.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    args = p.parse_args(argv)
    result = run(args)
    write_result(result, args.out)
    print(result.headline)


if __name__ == "__main__":
    main()
