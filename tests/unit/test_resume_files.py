"""Trainers' resume files are loaded weights-only: a planted pickle is refused and runs nothing.

Each trainer (TVQ, ETAPS, ACCT, and the TVQ/ETAPS ``export`` commands) finds its resume
file in the output folder. The planted file here is what an attacker with write access to
that folder would leave: a well-formed ``torch.save`` file whose unpickling calls
``Path.touch(marker)``. The genuine resume paths are covered by the trainers' own tests
(tests/unit/test_etaps_pruner.py, test_acct_algorithms.py, test_acct_cli_config.py,
test_etaps_export.py) and by the TVQ round trip below.
"""

from __future__ import annotations

import pathlib
import pickle
import zipfile
from dataclasses import replace

import pytest
import torch

from tests.etaps_models import tiny_llama
from vllm_ext.common.resume_file import UnsafeResumeFile, load_resume_state

pytestmark = pytest.mark.unit
torch.set_num_threads(1)


class _Payload:
    """Unpickling this calls ``Path.touch(marker)``: code run by merely loading the file."""

    def __init__(self, marker: pathlib.Path):
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (self.marker,))


def _plant(path: pathlib.Path, marker: pathlib.Path) -> pathlib.Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"step": 1, "settings": {}, "curve": [_Payload(marker)]}, path)
    return path


def test_the_planted_file_would_run_code_under_a_plain_unpickler(tmp_path):
    """The payload is live: a plain unpickler creates the marker (so the tests below can fail)."""
    marker = tmp_path / "pwned"
    planted = _plant(tmp_path / "state.pt", marker)
    # torch.save writes a zip around one pickle; the payload holds no tensors, so plain
    # pickle reads it as a full torch.load would
    with zipfile.ZipFile(planted) as archive:
        name = next(n for n in archive.namelist() if n.endswith("/data.pkl"))
        pickle.loads(archive.read(name))
    assert marker.exists()


def test_loader_refuses_with_one_clear_line(tmp_path):
    marker = tmp_path / "pwned"
    planted = _plant(tmp_path / "out" / "state.pt", marker)
    with pytest.raises(UnsafeResumeFile) as err:
        load_resume_state(planted)
    message = str(err.value)
    assert "\n" not in message and str(planted) in message and "planted" in message
    assert "Unsupported global" in message  # torch's first complaint, kept
    assert not marker.exists()


def test_loader_returns_a_genuine_state(tmp_path):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    saved = {"step": 3, "settings": {"checkpoints": (0.5, 0.7), "lr": 1e-3, "name": "x"},
             "curve": [{"loss": 1.0}], "opt": opt.state_dict(), "w": model.weight}  # fmt: skip
    torch.save(saved, tmp_path / "state.pt")
    back = load_resume_state(tmp_path / "state.pt")
    assert back["settings"] == saved["settings"] and back["curve"] == saved["curve"]
    assert torch.equal(back["w"], model.weight)
    torch.optim.Adam(model.parameters()).load_state_dict(back["opt"])


def test_etaps_pruner_and_export_refuse_a_planted_state(tmp_path):
    from tests.unit.test_etaps_pruner import SETTINGS
    from vllm_ext.etaps.cli import main
    from vllm_ext.etaps.pruner import StagedPruner

    marker = tmp_path / "pwned"
    _plant(tmp_path / "run" / "state.pt", marker)
    with pytest.raises(UnsafeResumeFile):
        StagedPruner(tiny_llama(0), SETTINGS, tmp_path / "run").resume()
    with pytest.raises(UnsafeResumeFile):
        main(["--threads", "1", "export", "--base", "tiny-llama", "--out", str(tmp_path / "run")])
    assert not marker.exists()


def test_acct_trainer_refuses_a_planted_state(tmp_path):
    from vllm_ext.acct.llama import TorchLlama
    from vllm_ext.acct.train import TRAINER_FILE, Trainer, TrainSettings
    from vllm_ext.assets import model_path

    marker = tmp_path / "pwned"
    _plant(tmp_path / "ck" / TRAINER_FILE, marker)
    folder = model_path("tiny-llama")
    trainer = Trainer(TorchLlama.from_pretrained(folder), folder, tmp_path / "ck",
                      TrainSettings(source_layers=1))  # fmt: skip
    with pytest.raises(UnsafeResumeFile):
        trainer.resume()
    assert not marker.exists()


def _tvq_run(tmp_path, steps: int):
    from vllm_ext.tvq.train import TrainSettings, init_student, train

    settings = TrainSettings(vec_dim=4, num_codewords=16, steps=steps, batch=1, seq_len=8,
                             relookup_every=1, calib_chunks=1, save_every=1)  # fmt: skip
    teacher = tiny_llama(0)
    torch.manual_seed(0)
    student = init_student(teacher, settings, None)
    data = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(0))
    return settings, student, train(teacher, student, data, settings, tmp_path / "tvq")


def test_tvq_train_resumes_a_genuine_state_and_refuses_a_planted_one(tmp_path):
    from vllm_ext.tvq.cli import main
    from vllm_ext.tvq.train import train

    settings, _, first = _tvq_run(tmp_path, steps=2)
    _, student, resumed = _tvq_run(tmp_path, steps=3)
    # resumed at step 2: the first two rows are the saved ones, one new step was run
    assert [r["step"] for r in resumed] == [1, 2, 3] and resumed[:2] == first
    marker = tmp_path / "pwned"
    _plant(tmp_path / "tvq" / "state.pt", marker)
    with pytest.raises(UnsafeResumeFile):
        train(tiny_llama(0), student, torch.zeros(1, 8, dtype=torch.long),
              replace(settings, steps=4), tmp_path / "tvq")  # fmt: skip
    with pytest.raises(UnsafeResumeFile):
        main(["--threads", "1", "export", "--base", "tiny-llama", "--out", str(tmp_path / "tvq")])
    assert not marker.exists()
