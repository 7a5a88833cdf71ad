"""Asset ``leap-smollm2``: LEAP length-predictor weights calibrated on the ``smollm2`` asset.

The build runs ``python -m vllm_ext.leap.calibrate`` (``load_prompts`` →
``record`` → ``fit``) on ShareGPT first turns in a subprocess: recording runs a
vLLM engine in-process, which needs ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` set
before vLLM is imported, and the process that builds assets must stay free of
a half-torn-down engine. The folder holds ``weights.npz`` (what
``--additional-config '{"leap": {"weights_path": ...}}'`` points to) and
``calibration.json`` (the held-out quality report of the fit).

This module only knows the recipe; :mod:`vllm_ext.assets.models` registers the
asset and hands :func:`build` the model folder (so it never imports models).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from vllm_ext.common.log import get_logger

logger = get_logger(__name__)

NAME = "leap-smollm2"
WEIGHTS_FILE = "weights.npz"
REPORT_FILE = "calibration.json"

# the calibration run; every value is part of the recipe string, so changing
# one (or the smollm2 recipe it is fitted on) rebuilds the asset
CALIBRATION = (
    ("prompts", "sharegpt"),
    ("num-prompts", "96"),
    ("max-tokens", "128"),
    ("temperature", "0.0"),
    ("seed", "0"),
)
RECIPE_VERSION = "leap-calib-v1"


def recipe(model_recipe: str) -> str:
    """Deterministic recipe string: our version, the model's recipe and the run settings."""
    settings = ",".join(f"{key}={value}" for key, value in CALIBRATION)
    return f"{RECIPE_VERSION}[{model_recipe}][{settings}]"


def calibrate_argv(model_dir: Path, out: Path) -> list[str]:
    """The calibrate CLI command line that writes ``out / weights.npz``."""
    argv = [sys.executable, "-m", "vllm_ext.leap.calibrate", "--model", str(model_dir)]
    argv += ["--out", str(out / WEIGHTS_FILE)]
    for key, value in CALIBRATION:
        argv += [f"--{key}", value]
    return argv


def build(out: Path, model_dir: Path) -> None:
    """Calibrate on ``model_dir`` and write ``weights.npz`` + ``calibration.json`` into ``out``."""
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    logger.info("Calibrating LEAP on %s (ShareGPT, ~1 min on CPU)", model_dir)
    result = subprocess.run(calibrate_argv(model_dir, out), env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(
            f"LEAP calibration failed (exit {result.returncode}):\n{result.stderr[-4000:]}"
        )
    # the CLI writes its report beside the weights as <stem>.json
    (out / WEIGHTS_FILE).with_suffix(".json").rename(out / REPORT_FILE)
