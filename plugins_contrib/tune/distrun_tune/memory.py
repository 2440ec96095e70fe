"""What "fits" means for the batch-size finder: a rank's peak memory over a trial.

On CUDA the device's peak reserved memory (the caching allocator's), and an out-of-memory
error is a trial that does not fit. On CPU there is no out-of-memory error to catch (the
kernel kills the process, or swaps), so the budget is the process's peak resident set size:
Linux keeps it as ``VmHWM`` in ``/proc/self/status`` and resets it to the current RSS when
``5`` is written to ``/proc/self/clear_refs``, so each trial measures its own peak.
"""

from __future__ import annotations

import gc
import re
from typing import Any

from distrun.plugin import UsageError

__all__ = ["PeakMemory", "format_bytes", "parse_bytes"]

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3,
          "gb": 1000**3, "t": 1000**4, "tb": 1000**4, "kib": 1024, "mib": 1024**2,
          "gib": 1024**3, "tib": 1024**4}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str) -> int:
    """``"4GiB"``, ``"512MiB"``, ``"1.5GB"``, ``"1000000"`` -> bytes."""
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise UsageError(f"--tune-max-memory {text!r} is not a size (write e.g. 4GiB, 512MiB "
                         "or 2GB)")
    return int(float(match.group(1)) * _UNITS[unit])


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"/proc/self/status has no {field}")


class PeakMemory:
    """The peak memory of this rank between :meth:`reset` and :meth:`peak`, in bytes."""

    def __init__(self, device: Any) -> None:
        import torch

        self.device = device
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.capacity: int | None = torch.cuda.get_device_properties(device).total_memory
            return
        self.capacity = None
        try:
            self._reset_rss()
            _status_kib("VmHWM")
        except OSError as exc:
            raise UsageError(f"the batch-size finder reads a CPU rank's peak RSS from /proc "
                             f"(Linux), which is not readable here ({exc})") from None

    @staticmethod
    def _reset_rss() -> None:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")

    def current(self) -> int:
        """Memory in use now (RSS on CPU, reserved on CUDA)."""
        import torch

        if self.cuda:
            return int(torch.cuda.memory_reserved(self.device))
        return _status_kib("VmRSS") * 1024

    def reset(self) -> None:
        import torch

        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._reset_rss()

    def peak(self) -> int:
        import torch

        if self.cuda:
            torch.cuda.synchronize(self.device)
            return int(torch.cuda.max_memory_reserved(self.device))
        return _status_kib("VmHWM") * 1024
