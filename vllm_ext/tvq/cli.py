"""``python -m vllm_ext.tvq train|export|eval``.

- ``train --out DIR [--steps N ...]``: k-means init + STE distillation of SmolLM2's MLPs;
  resumes from ``DIR/state.pt``; writes ``DIR/curve.json`` and the checkpoint ``DIR/ckpt``
  (``--steps 0 --skip-eval``: the plain VQ checkpoint, no perplexity).
- ``export --out DIR``: re-export ``DIR/ckpt`` from ``DIR/state.pt`` (``--steps 0`` in train
  gives plain VQ, no training).
- ``eval --ckpt DIR [--chunks N]``: held-out ShareGPT perplexity of a checkpoint in torch.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import fields
from pathlib import Path

import torch

from vllm_ext.common.resume_file import load_resume_state
from vllm_ext.tvq.train import TrainSettings


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m vllm_ext.tvq")
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="init + distil; resumable")
    for f in fields(TrainSettings):
        t.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default)
    t.add_argument(
        "--skip-eval",
        action="store_true",
        help="no held-out perplexity before/after (with --steps 0: export plain VQ)",
    )
    for cmd in (t, sub.add_parser("export", help="write DIR/ckpt from DIR/state.pt")):
        cmd.add_argument("--out", type=Path, required=True)
        cmd.add_argument("--base", default="smollm2", help="model asset name or folder")
    e = sub.add_parser("eval", help="held-out perplexity of a checkpoint (torch)")
    e.add_argument("--ckpt", type=Path, required=True)
    e.add_argument("--chunks", type=int, default=4)
    e.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    return p


def _base(name: str) -> Path:
    from vllm_ext.assets import model_path

    return Path(name) if Path(name).is_dir() else model_path(name)


def _teacher(base: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(base)


def _settings(args) -> TrainSettings:
    return TrainSettings(**{f.name: getattr(args, f.name) for f in fields(TrainSettings)})


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    from vllm_ext.tvq import data, export, train
    from vllm_ext.tvq.format import QuantFormat

    if args.cmd == "eval":
        from transformers import AutoTokenizer

        model = export.load_reference(args.ckpt)
        tok = AutoTokenizer.from_pretrained(args.ckpt)
        chunks = data.token_chunks(tok, args.chunks, args.seq_len, held_out=True)
        print(json.dumps({"ckpt": str(args.ckpt), "ppl": train.perplexity(model, chunks)}))
        return 0
    base = _base(args.base)
    teacher, tok = _teacher(base)
    if args.cmd == "export":
        state = load_resume_state(args.out / "state.pt")
        settings = TrainSettings(**state["settings"])
    else:
        settings = _settings(args)
    torch.manual_seed(settings.seed)
    calib = data.token_chunks(tok, settings.calib_chunks, settings.seq_len, held_out=False)
    student = train.init_student(teacher, settings, calib)
    if args.cmd == "train":
        chunks = data.token_chunks(tok, 256, settings.seq_len, held_out=False)
        held_out = data.token_chunks(tok, 4, 512, held_out=True)
        ppl = (lambda: None) if args.skip_eval else (lambda: train.perplexity(student, held_out))
        summary = {"ppl_init": ppl()}
        print(json.dumps(summary), flush=True)
        curve = train.train(teacher, student, chunks, settings, args.out)
        summary.update(ppl_trained=ppl(), steps=settings.steps,
                       tokens=curve[-1]["tokens"] if curve else 0)  # fmt: skip
        (args.out / "summary.json").write_text(json.dumps(summary) + "\n")
        print(json.dumps(summary))
    else:
        student.load_state_dict(state["student"])
    fmt = QuantFormat(settings.vec_dim, settings.num_codewords)
    print(export.export(student, base, args.out / "ckpt", fmt))
    return 0
