"""``python -m vllm_ext.acct train|eval``: fit converters, measure them, write their gate."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields
from pathlib import Path

import torch
from tqdm import tqdm

from vllm_ext.acct import checkpoint as ckpt
from vllm_ext.acct.data import eval_windows, train_windows
from vllm_ext.acct.llama import TorchLlama
from vllm_ext.acct.quality import evaluate, gate_report
from vllm_ext.acct.train import Trainer, TrainSettings


def resolve_model(name: str) -> Path:
    path = Path(name)
    if path.is_dir():
        return path
    from vllm_ext.assets import model_path

    return model_path(name)


def _tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def cmd_train(args) -> int:
    settings = TrainSettings(**{f.name: getattr(args, f.name) for f in fields(TrainSettings)})
    model_dir = resolve_model(args.model)
    target = TorchLlama.from_pretrained(model_dir)
    tok = _tokenizer(model_dir)
    trainer = Trainer(target, model_dir, args.out, settings)
    if trainer.resume():
        print(f"resumed at step {trainer.step}", file=sys.stderr)
    else:
        ridge = train_windows(
            tok,
            settings.context,
            settings.continuation,
            settings.conversations,
            settings.seed + 10**6,
        )
        windows = [next(ridge) for _ in tqdm(range(settings.ridge_windows), desc="ridge data")]
        trainer.init_ridge(windows)
    if settings.steps > trainer.step:
        stream = train_windows(
            tok,
            settings.context,
            settings.continuation,
            settings.conversations,
            settings.seed + trainer.step,
        )
        with tqdm(total=settings.steps, initial=trainer.step, desc="KL training") as bar:
            trainer.train(stream, bar)
    print(json.dumps({"out": str(args.out), "step": trainer.step}))
    return 0


def cmd_eval(args) -> int:
    model_dir = resolve_model(args.model)
    target = TorchLlama.from_pretrained(model_dir)
    pipeline, meta = ckpt.load_pipeline(args.checkpoint, model_dir, target, args.tail_tokens)
    windows = eval_windows(_tokenizer(model_dir), args.context, args.continuation, args.windows)
    with tqdm(total=len(windows), desc="eval") as bar:
        result = evaluate(pipeline, windows, bar)
    settings = {
        "context": args.context,
        "continuation": args.continuation,
        "source_layers": pipeline.source_layers,
        "sink_tokens": pipeline.sink_tokens,
        "tail_tokens": pipeline.tail_tokens,
    }
    gate = gate_report(result, args.max_delta_nll, args.min_top1, settings)
    result["gate"] = gate
    if args.write_gate:
        if meta is None:
            raise SystemExit("the identity import is exact by construction: no gate to write")
        ckpt.write_gate(args.checkpoint, gate, pipeline.tail_tokens)
    text = json.dumps(result, indent=2, sort_keys=True)
    if args.json:
        Path(args.json).write_text(text + "\n")
    print(json.dumps({"means": result["means"], "gate": gate}, indent=2, sort_keys=True))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m vllm_ext.acct", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="ridge-initialise, then KL-train converters")
    train.add_argument("--out", required=True, help="checkpoint folder (resumed if present)")
    train.add_argument("--model", default="smollm2", help="asset name or HF Llama folder")
    for f in fields(TrainSettings):
        train.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)
    ev = sub.add_parser("eval", help="own prefill vs import vs truncation vs no context")
    ev.add_argument("--checkpoint", required=True, help=f"checkpoint folder or {ckpt.IDENTITY!r}")
    ev.add_argument("--model", default="smollm2")
    ev.add_argument("--windows", type=int, default=8)
    ev.add_argument("--context", type=int, default=1536)
    ev.add_argument("--continuation", type=int, default=256)
    ev.add_argument("--max-delta-nll", type=float, default=0.05)
    ev.add_argument("--min-top1", type=float, default=0.97)
    ev.add_argument("--tail-tokens", type=int, help="override the checkpoint's exact tail")
    ev.add_argument("--write-gate", action="store_true", help="store the gate in the checkpoint")
    ev.add_argument("--json", help="write the full result here")
    for p in (train, ev):
        p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    return {"train": cmd_train, "eval": cmd_eval}[args.command](args)
