"""RoCE source ports for queue pairs ARK owns (``csrc/ark/ark_roce_sport.c``).

``mlx5dv_modify_qp_udp_sport`` sets a RoCE v2 QP's UDP source port, the field a
fabric's ECMP hash sees; only a transport that creates its own QPs can call it
(UCX/NIXL keep theirs private). Built against rdma-core when its headers exist
(Debian: ``libibverbs-dev``); otherwise the argument checks build and setting a
port reports ``ENOSYS``.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

from vllm_ext.ark.shim import CACHE, build

SOURCE = Path(__file__).resolve().parents[2] / "csrc" / "ark" / "ark_roce_sport.c"
HEADER = Path("/usr/include/infiniband/mlx5dv.h")


class RoceError(OSError):
    """Setting a QP's source port failed; ``errno`` says why."""


def load(cache: Path = CACHE, header: Path = HEADER) -> ctypes.CDLL:
    """The compiled extension, linked to libibverbs/libmlx5 when rdma-core's headers exist."""
    libs = ("-libverbs", "-lmlx5") if header.is_file() else ()
    lib = ctypes.CDLL(str(build(cache, SOURCE, libs)))
    lib.ark_roce_set_sport.argtypes = [ctypes.c_void_p, ctypes.c_int]
    return lib


def set_udp_sport(lib: ctypes.CDLL, qp: int | None, sport: int) -> None:
    """Give the ``ibv_qp`` at address ``qp`` the UDP source port ``sport``; raises RoceError."""
    rc = lib.ark_roce_set_sport(qp, sport)
    if rc:
        raise RoceError(-rc, f"set RoCE UDP source port {sport}: {os.strerror(-rc)}")


def has_mlx5dv(lib: ctypes.CDLL) -> bool:
    return bool(lib.ark_roce_has_mlx5dv())


__all__ = ["RoceError", "has_mlx5dv", "load", "set_udp_sport"]
