"""GPU power and clock sampling through NVML during a benchmark.

A GPU can run far below its power limit on small kernels, and two nodes that
look identical can differ 2x in clocks or enforced power limit. Wrapping a
benchmark in :class:`GpuPowerSampler` records power draw vs. the enforced
limit and SM clock vs. its maximum, so results carry that explanation.

``pynvml`` (package ``nvidia-ml-py``) is imported lazily and is optional:
without it, or without a GPU/driver, the sampler records
``{"available": False, "reason": ...}`` and does nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

from vllm_ext.bench.stats import percentile

logger = logging.getLogger(__name__)

_FIELDS = (
    "power_w",
    "power_limit_w",
    "sm_clock_mhz",
    "mem_clock_mhz",
    "max_sm_clock_mhz",
    "util_gpu_pct",
    "util_mem_pct",
    "temperature_c",
)


def _load_nvml() -> ModuleType:
    """Import pynvml lazily; raises ImportError when not installed."""
    import pynvml  # lazy: optional dependency

    return pynvml


class GpuPowerSampler:
    """Context manager sampling NVML metrics every ``interval_s`` seconds.

    Usage::

        with GpuPowerSampler(interval_s=0.1) as sampler:
            run_benchmark()
        power = sampler.summary()

    ``devices`` restricts sampling to some NVML indices; ``nvml`` injects a
    module with pynvml's API (used by tests).
    """

    def __init__(
        self,
        interval_s: float = 0.1,
        devices: list[int] | None = None,
        nvml: ModuleType | Any | None = None,
    ) -> None:
        """Configure the sampler; nothing is sampled until :meth:`start`."""
        if interval_s <= 0:
            raise ValueError("interval_s must be positive")
        self.interval_s = interval_s
        self._devices = devices
        self._nvml = nvml
        self._handles: list[tuple[int, str, Any]] = []
        self._samples: dict[int, list[dict[str, float | None]]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._started = self._ended = 0.0
        self.available = False
        self.reason: str | None = "sampler not started"

    def __enter__(self) -> GpuPowerSampler:
        """Start sampling."""
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        """Stop sampling."""
        self.stop()

    def start(self) -> None:
        """Initialise NVML and start the sampling thread (no-op without GPU)."""
        try:
            nvml = self._nvml if self._nvml is not None else _load_nvml()
            nvml.nvmlInit()
        except Exception as exc:  # noqa: BLE001 - ImportError or NVMLError
            self.available, self.reason = False, f"NVML unavailable: {exc}"
            logger.info("GPU power sampling disabled: %s", self.reason)
            return
        self._nvml = nvml
        try:
            count = nvml.nvmlDeviceGetCount()
            indices = self._devices if self._devices is not None else range(count)
            for idx in indices:
                handle = nvml.nvmlDeviceGetHandleByIndex(idx)
                name = nvml.nvmlDeviceGetName(handle)
                name = name.decode() if isinstance(name, bytes) else str(name)
                self._handles.append((idx, name, handle))
                self._samples[idx] = []
        except Exception as exc:  # noqa: BLE001
            self._shutdown()
            self.available, self.reason = False, f"NVML device query failed: {exc}"
            return
        if not self._handles:
            self._shutdown()
            self.available, self.reason = False, "no GPU visible to NVML"
            return
        self.available, self.reason = True, None
        self._started = time.monotonic()
        self._sample_all()
        self._thread = threading.Thread(target=self._loop, name="gpu-power-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop sampling (takes one final sample) and shut NVML down."""
        if not self.available or self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout=max(5.0, 10 * self.interval_s))
        self._thread = None
        self._sample_all()
        self._ended = time.monotonic()
        self._shutdown()

    def _shutdown(self) -> None:
        """Call nvmlShutdown, logging (not raising) failures."""
        try:
            self._nvml.nvmlShutdown()
        except Exception as exc:  # noqa: BLE001
            logger.debug("nvmlShutdown failed: %s", exc)

    def _loop(self) -> None:
        """Sampling thread body."""
        while not self._stop.wait(self.interval_s):
            self._sample_all()

    def _sample_all(self) -> None:
        """Take one sample of every tracked GPU."""
        for idx, _name, handle in self._handles:
            self._samples[idx].append(self._sample(handle))

    def _sample(self, handle: Any) -> dict[str, float | None]:
        """One reading of all fields; unsupported fields become None."""
        nv = self._nvml

        def read(fn: Callable[[], float]) -> float | None:
            """``float(fn())`` or None when the field is unsupported."""
            try:
                return float(fn())
            except Exception:  # noqa: BLE001 - field unsupported on this GPU
                return None

        util = None
        try:
            util = nv.nvmlDeviceGetUtilizationRates(handle)
        except Exception:  # noqa: BLE001
            util = None
        return {
            "t_s": time.monotonic() - self._started,
            "power_w": read(lambda: nv.nvmlDeviceGetPowerUsage(handle) / 1000.0),
            "power_limit_w": read(lambda: nv.nvmlDeviceGetEnforcedPowerLimit(handle) / 1000.0),
            "sm_clock_mhz": read(lambda: nv.nvmlDeviceGetClockInfo(handle, nv.NVML_CLOCK_SM)),
            "mem_clock_mhz": read(lambda: nv.nvmlDeviceGetClockInfo(handle, nv.NVML_CLOCK_MEM)),
            "max_sm_clock_mhz": read(
                lambda: nv.nvmlDeviceGetMaxClockInfo(handle, nv.NVML_CLOCK_SM)
            ),
            "util_gpu_pct": float(util.gpu) if util is not None else None,
            "util_mem_pct": float(util.memory) if util is not None else None,
            "temperature_c": read(
                lambda: nv.nvmlDeviceGetTemperature(handle, nv.NVML_TEMPERATURE_GPU)
            ),
        }

    def samples(self) -> dict[int, list[dict[str, float | None]]]:
        """Raw samples per GPU index (copies)."""
        return {idx: list(rows) for idx, rows in self._samples.items()}

    def summary(self) -> dict[str, Any]:
        """Per-GPU medians/p90/max plus power and clock fractions.

        Returns ``{"available": False, "reason": ...}`` when nothing was
        sampled.
        """
        if not self.available and not any(self._samples.values()):
            return {"available": False, "reason": self.reason or "unknown"}
        end = self._ended or time.monotonic()
        gpus = [
            _summarize_gpu(idx, name, self._samples[idx]) for idx, name, _handle in self._handles
        ]
        return {
            "available": True,
            "interval_s": self.interval_s,
            "duration_s": end - self._started,
            "gpus": gpus,
        }


def _ratio_median(rows: list[dict[str, float | None]], num: str, den: str) -> float | None:
    """Median over samples of ``rows[num] / rows[den]``."""
    values = [r[num] / r[den] for r in rows if r.get(num) is not None and r.get(den)]
    return percentile(values, 50)


def _summarize_gpu(idx: int, name: str, rows: list[dict[str, float | None]]) -> dict[str, Any]:
    """Summary statistics of one GPU's samples."""
    out: dict[str, Any] = {"index": idx, "name": name, "n_samples": len(rows)}
    for field in _FIELDS:
        values = [r[field] for r in rows if r.get(field) is not None]
        out[field] = {
            "p50": percentile(values, 50),
            "p90": percentile(values, 90),
            "max": max(values) if values else None,
        }
    out["power_fraction_of_limit"] = _ratio_median(rows, "power_w", "power_limit_w")
    out["sm_clock_fraction_of_max"] = _ratio_median(rows, "sm_clock_mhz", "max_sm_clock_mhz")
    return out
