"""Loading the trainers' resume files (TVQ, ETAPS, ACCT) without running code from them.

A resume file sits in a user's output folder, where anyone who can write that folder could
plant one. A full ``torch.load`` (weights_only off) unpickles arbitrary objects, so a planted
file would run code as the trainer's user. Our resume files hold only tensors, numbers,
strings and plain containers (settings go in as ``dataclasses.asdict``, optimizer state is
torch's own), all of which torch's weights-only unpickler accepts, so we never need more.
Algorithm modules import this file: it imports no vLLM.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch


class UnsafeResumeFile(ValueError):
    """A resume file holds objects the weights-only unpickler refuses (possibly planted)."""


def load_resume_state(path: Path | str) -> Any:
    """``torch.load`` of a resume file with ``weights_only=True``; one-line error if refused.

    Args:
        path: the ``.pt`` file a trainer wrote with ``torch.save``.
    Returns:
        The saved object (a dict of tensors, numbers, strings, lists and dicts).
    """
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as err:
        # torch's message is many lines and suggests turning weights_only off; keep its first
        # complaint (the offending global) and say what to do instead
        reason = _offending_global(str(err))
        raise UnsafeResumeFile(
            f"refusing to resume from {path}: not plain data ({reason}); our trainers write "
            "only tensors, numbers, strings and containers, so it may have been planted: "
            "remove it to start fresh, and check who can write that folder"
        ) from None


def _offending_global(message: str) -> str:
    for line in message.splitlines():
        line = line.strip()
        if line.startswith("WeightsUnpickler error:"):
            # "Unsupported global: GLOBAL getattr was not an allowed global by default. ..."
            return line.removeprefix("WeightsUnpickler error:").split(". ")[0].strip()
    return message.strip().splitlines()[0] if message.strip() else "unpickling failed"
