"""``python -m vllm_ext.etaps prune|export|eval``.

- ``prune --out DIR [--method etaps] [--final-sparsity 0.9 --stages 5 ...]``: the staged
  pruner on ShareGPT blocks; resumes from ``DIR/state.pt``; exports ``DIR/ckpt-<pct>`` at
  the final sparsity and at every ``--checkpoints`` one; ``DIR/summary.json`` holds the
  per-stage log and the pruner's extra memory. ``--method wanda|sparsegpt|magnitude``
  prunes one-shot to ``--final-sparsity`` on ``--calib-blocks`` blocks instead;
  ``--method admm`` (ELSA-like) runs one ADMM iteration per calibration block, with the
  settings :data:`vllm_ext.etaps.admm.FEW_BLOCKS`.
- ``export --out DIR``: re-export ``DIR/ckpt-<pct>`` from ``DIR/state.pt`` (last finished stage).
- ``eval --ckpt DIR [--blocks 4 --block-len 512]``: held-out ShareGPT perplexity in torch.

``vllm serve DIR/ckpt-90`` then serves the sparse checkpoint (docs/etaps.md).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import fields
from pathlib import Path

import torch

from vllm_ext.common.resume_file import load_resume_state
from vllm_ext.etaps.pruner import PruneSettings

METHODS = ("etaps", "wanda", "sparsegpt", "magnitude", "admm")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m vllm_ext.etaps", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu", help="where the model and the pruner run")
    sub = p.add_subparsers(dest="cmd", required=True)
    prune = sub.add_parser("prune", help="staged ETAPS pruning (resumable) or a one-shot baseline")
    prune.add_argument("--method", choices=METHODS, default="etaps")
    for f in fields(PruneSettings):
        if f.name == "checkpoints":
            hint = "extra sparsities to export on the way, e.g. 0.7,0.8"
            prune.add_argument("--checkpoints", default="", help=hint)
        else:
            prune.add_argument("--" + f.name.replace("_", "-"), type=type(f.default),
                               default=f.default)  # fmt: skip
    export = sub.add_parser("export", help="write DIR/ckpt-<pct> from DIR/state.pt")
    for cmd in (prune, export):
        cmd.add_argument("--out", type=Path, required=True)
        cmd.add_argument("--base", default="smollm2", help="model asset name or HF folder")
    ev = sub.add_parser("eval", help="held-out perplexity of a checkpoint (torch)")
    ev.add_argument("--ckpt", type=Path, required=True)
    ev.add_argument("--blocks", type=int, default=4)
    ev.add_argument("--block-len", type=int, default=512)
    return p


def _base(name: str) -> Path:
    from vllm_ext.assets import model_path

    return Path(name) if Path(name).is_dir() else model_path(name)


def _settings(args) -> PruneSettings:
    values = {f.name: getattr(args, f.name) for f in fields(PruneSettings)}
    values["checkpoints"] = tuple(float(c) for c in args.checkpoints.split(",") if c)
    return PruneSettings(**values)


def ckpt_dir(out: Path, sparsity: float) -> Path:
    return out / f"ckpt-{round(sparsity * 100):d}"


def _model_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _prune_etaps(model, tok, base: Path, settings: PruneSettings, out: Path, device) -> dict:
    from vllm_ext.etaps.data import token_blocks
    from vllm_ext.etaps.export import export_state
    from vllm_ext.etaps.pruner import StagedPruner

    exports = {round(s, 6) for s in settings.checkpoints} | {round(settings.final_sparsity, 6)}
    model_bytes = _model_bytes(model)
    pruner = StagedPruner(model, settings, out)
    if pruner.resume():
        print(f"resumed after stage {pruner.done} of {len(settings.targets())}", flush=True)
    n_blocks = len(settings.targets()) * settings.blocks_per_stage()
    blocks = token_blocks(tok, n_blocks, settings.block_len, held_out=False).to(device)

    def on_stage(sparsity: float, p: StagedPruner) -> None:
        if round(sparsity, 6) in exports:
            path = export_state(p.export_state(), list(p.layers), base,
                                ckpt_dir(out, sparsity), sparsity)  # fmt: skip
            print(f"exported {path}", flush=True)

    log = pruner.run(blocks, on_stage)
    return {"method": "etaps", "log": log, "tokens": n_blocks * settings.block_len,
            "pruner_state_bytes": pruner.state_bytes(), "model_bytes": model_bytes}  # fmt: skip


def _prune_one_shot(model, tok, base: Path, settings: PruneSettings, method: str,
                    out: Path, device) -> dict:  # fmt: skip
    from vllm_ext.etaps.admm import FEW_BLOCKS, prune_admm
    from vllm_ext.etaps.baselines import input_sq_sums, prune_one_shot
    from vllm_ext.etaps.data import token_blocks
    from vllm_ext.etaps.export import export
    from vllm_ext.etaps.sparsegpt import prune_sparsegpt

    s = settings.final_sparsity
    blocks = token_blocks(tok, settings.calib_blocks, settings.block_len, held_out=False)
    blocks = blocks.to(device)
    summary = {"method": method, "sparsity": s, "tokens": blocks.numel()}
    if method == "sparsegpt":
        prune_sparsegpt(model, blocks, s)
    elif method == "admm":
        stats = prune_admm(model, blocks, s, **FEW_BLOCKS)
        summary |= {"loss": stats["loss"], "pruner_state_bytes": stats["extra_state_bytes"],
                    "model_bytes": _model_bytes(model)}  # fmt: skip
    else:
        prune_one_shot(model, s, input_sq_sums(model, blocks) if method == "wanda" else None)
    path = export(model, base, ckpt_dir(out, s), s)
    print(f"exported {path}", flush=True)
    return summary


def _eval(args) -> dict:
    from transformers import AutoTokenizer

    from vllm_ext.etaps.data import token_blocks
    from vllm_ext.etaps.export import load_reference
    from vllm_ext.etaps.model_io import perplexity

    model = load_reference(args.ckpt)
    tok = AutoTokenizer.from_pretrained(args.ckpt)
    held_out = token_blocks(tok, args.blocks, args.block_len, held_out=True)
    return {"ckpt": str(args.ckpt), "ppl": perplexity(model, held_out),
            "tokens": held_out.numel()}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.cmd == "eval":
        print(json.dumps(_eval(args)))
        return 0
    from vllm_ext.etaps.model_io import load_model

    base = _base(args.base)
    model, tok = load_model(base)
    model.to(args.device)
    if args.cmd == "export":
        return _reexport(model, base, args.out)
    settings = _settings(args)
    torch.manual_seed(settings.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.method == "etaps":
        summary = _prune_etaps(model, tok, base, settings, args.out, args.device)
    else:
        summary = _prune_one_shot(model, tok, base, settings, args.method, args.out,
                                  args.device)  # fmt: skip
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    if "pruner_state_bytes" in summary:
        print(f"pruner state beyond the model: {summary['pruner_state_bytes'] / 2**20:.0f} MiB "
              f"(model {summary['model_bytes'] / 2**20:.0f} MiB)")  # fmt: skip
    return 0


def _reexport(model, base: Path, out: Path) -> int:
    from vllm_ext.etaps.export import export_state
    from vllm_ext.etaps.pruner import StagedPruner

    state = load_resume_state(out / "state.pt")
    saved = state["settings"]
    settings = PruneSettings(**{**saved, "checkpoints": tuple(saved["checkpoints"])})
    pruner = StagedPruner(model, settings, out)
    if not pruner.resume() or pruner.done == 0:
        raise SystemExit(f"{out}/state.pt has no finished stage to export")
    s = settings.targets()[pruner.done - 1]
    print(export_state(pruner.export_state(), list(pruner.layers), base, ckpt_dir(out, s), s))
    return 0
