"""The staged pruner: calibrate, score ``|w+Δ|·Σ|g|``, prune, migrate slots, train Δ.

Resumable: the state after every stage goes to ``<out>/state.pt``; a rerun with
the same settings continues after the last finished stage.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from vllm_ext.common.resume_file import load_resume_state
from vllm_ext.etaps.model_io import prunable_linears
from vllm_ext.etaps.schedule import sparsity_schedule
from vllm_ext.etaps.scores import etaps_score, row_mask
from vllm_ext.etaps.slots import initial_slots, migrate_slots
from vllm_ext.etaps.slotted import SlottedLinear


@dataclasses.dataclass(frozen=True)
class PruneSettings:
    """Hyper-parameters of one ETAPS run (``python -m vllm_ext.etaps prune --help``)."""

    final_sparsity: float = 0.9
    stages: int = 5
    start_sparsity: float = 0.5
    checkpoints: tuple[float, ...] = ()
    calib_blocks: int = 2
    train_steps: int = 6
    block_len: int = 512
    slot_fraction: float = 0.01
    lr: float = 2e-4
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 < self.slot_fraction < 0.5:
            raise ValueError(f"slot_fraction must be in (0, 0.5), got {self.slot_fraction}")
        if self.calib_blocks < 1 or self.train_steps < 0:
            raise ValueError("calib_blocks must be >= 1 and train_steps >= 0")
        self.targets()  # validates the schedule

    def targets(self) -> list[float]:
        return sparsity_schedule(
            self.final_sparsity, self.stages, start=self.start_sparsity,
            checkpoints=self.checkpoints,
        )  # fmt: skip

    def blocks_per_stage(self) -> int:
        return self.calib_blocks + self.train_steps


def install_slots(model: torch.nn.Module, slot_fraction: float) -> dict[str, SlottedLinear]:
    """Swap every prunable ``nn.Linear`` for a :class:`SlottedLinear` (in place)."""
    swapped = {}
    for name, linear in prunable_linears(model).items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        n_slots = max(1, int(linear.weight.numel() * slot_fraction))
        swapped[name] = SlottedLinear(linear, n_slots)
        parent.register_module(child, swapped[name])  # replaces the nn.Linear child
    return swapped


def lm_loss(model: torch.nn.Module, block: torch.Tensor) -> torch.Tensor:
    logits = model(block.unsqueeze(0)).logits[0, :-1]
    return F.cross_entropy(logits.float(), block[1:])


class StagedPruner:
    """Runs the schedule of ``settings`` on ``model`` (modified in place)."""

    def __init__(self, model: torch.nn.Module, settings: PruneSettings, out: Path) -> None:
        self.model = model
        self.settings = settings
        self.out = Path(out)
        self.layers = install_slots(model, settings.slot_fraction)
        self.deltas = [layer.delta for layer in self.layers.values()]
        self.optimizer = torch.optim.Adam(self.deltas, lr=settings.lr)
        self.done = 0  # stages finished
        self.slots_placed = False
        self.log: list[dict] = []

    def _track(self, on: bool) -> None:
        for layer in self.layers.values():
            layer.tracking = on

    def calibrate(self, blocks: torch.Tensor) -> None:
        """Accumulate ``Σ|g|`` over ``blocks`` (no update)."""
        self._track(True)
        for block in blocks:
            lm_loss(self.model, block).backward()
        self._track(False)
        self.optimizer.zero_grad(set_to_none=True)

    def prune_to(self, sparsity: float) -> int:
        """Prune each row to ``sparsity`` by the ETAPS score; move dead slots. Returns moves."""
        moved = 0
        with torch.no_grad():
            for layer in self.layers.values():
                dense = layer.effective_weight() - layer.weight
                score = etaps_score(layer.weight, dense, layer.grad_sum)
                layer.apply_mask(row_mask(score, sparsity, keep=layer.keep))
                if not self.slots_placed:
                    layer.slots.copy_(initial_slots(layer.grad_sum, layer.keep, layer.n_slots))
                    layer.delta.zero_()
                    continue
                slots, delta, dead = migrate_slots(
                    layer.slots, layer.delta.detach(), layer.grad_sum, layer.keep
                )
                layer.slots.copy_(slots)
                layer.delta.copy_(delta)
                moved += int(dead.sum())
                self._reset_adam(layer.delta, dead)
                layer.grad_sum.zero_()
            if not self.slots_placed:
                for layer in self.layers.values():
                    layer.grad_sum.zero_()
            self.slots_placed = True
        return moved

    def _reset_adam(self, param: torch.Tensor, dead: torch.Tensor) -> None:
        state = self.optimizer.state.get(param)
        if state:
            state["exp_avg"][dead] = 0.0
            state["exp_avg_sq"][dead] = 0.0

    def train(self, blocks: torch.Tensor) -> list[float]:
        """One Adam step on the increments per block; gradients also feed ``Σ|g|``."""
        losses = []
        self._track(True)
        for block in blocks:
            self.optimizer.zero_grad(set_to_none=True)
            loss = lm_loss(self.model, block)
            loss.backward()
            self.optimizer.step()
            losses.append(float(loss.detach()))
        self._track(False)
        return losses

    def run(
        self,
        blocks: torch.Tensor,
        on_stage: Callable[[float, StagedPruner], None] | None = None,
    ) -> list[dict]:
        """All remaining stages; ``blocks`` holds ``stages × blocks_per_stage`` blocks."""
        targets = self.settings.targets()
        per = self.settings.blocks_per_stage()
        if blocks.shape[0] < len(targets) * per:
            raise ValueError(f"need {len(targets) * per} blocks, got {blocks.shape[0]}")
        calib = self.settings.calib_blocks
        bar = tqdm(total=len(targets), initial=self.done, desc="etaps stages", unit="stage")
        for i in range(self.done, len(targets)):
            stage_blocks = blocks[i * per : (i + 1) * per]
            start = time.process_time()
            self.calibrate(stage_blocks[:calib])
            moved = self.prune_to(targets[i])
            losses = self.train(stage_blocks[calib:])
            self.done = i + 1
            self.log.append({
                "sparsity": targets[i], "slots_moved": moved, "train_loss": losses,
                "cpu_s": time.process_time() - start,
            })  # fmt: skip
            self.save()
            if on_stage is not None:
                on_stage(targets[i], self)
            bar.set_postfix(sparsity=targets[i], loss=losses[-1] if losses else None)
            bar.update(1)
        bar.close()
        return self.log

    def state_bytes(self) -> int:
        return sum(layer.state_bytes() for layer in self.layers.values())

    def patched_state_dict(self) -> dict[str, torch.Tensor]:
        """``{"<linear>.weight": (w+Δ)⊙mask}`` for every pruned linear."""
        return {f"{n}.weight": layer.patched_weight() for n, layer in self.layers.items()}

    @torch.no_grad()
    def export_state(self) -> dict[str, torch.Tensor]:
        """The model's state dict as a plain HF model would hold it, pruned weights patched."""
        state = self.model.state_dict()
        for name, layer in self.layers.items():
            for key in [k for k in state if k.startswith(name + ".")]:
                del state[key]
            state[f"{name}.weight"] = layer.patched_weight()
            if layer.bias is not None:
                state[f"{name}.bias"] = layer.bias.detach()
        return state

    def save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        layers = {
            name: {k: getattr(layer, k) for k in ("keep", "grad_sum", "slots")}
            | {"delta": layer.delta.detach()}
            for name, layer in self.layers.items()
        }
        state = {
            "settings": dataclasses.asdict(self.settings), "done": self.done, "log": self.log,
            "layers": layers, "optimizer": self.optimizer.state_dict(),
        }  # fmt: skip
        tmp = self.out / "state.pt.tmp"
        torch.save(state, tmp)
        tmp.replace(self.out / "state.pt")

    def resume(self) -> bool:
        """Load ``<out>/state.pt`` if there is one for the same settings; True if loaded."""
        path = self.out / "state.pt"
        if not path.exists():
            return False
        state = load_resume_state(path)
        if state["settings"] != dataclasses.asdict(self.settings):
            raise ValueError(f"{path} was written with other settings: {state['settings']}")
        with torch.no_grad():
            for name, saved in state["layers"].items():
                layer = self.layers[name]
                layer.apply_mask(saved["keep"])
                layer.grad_sum.copy_(saved["grad_sum"])
                layer.slots.copy_(saved["slots"])
                layer.delta.copy_(saved["delta"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.done, self.log = state["done"], state["log"]
        self.slots_placed = self.done > 0
        return True
