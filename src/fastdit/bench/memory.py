"""Peak memory of a stretch of work, on a GPU or on the CPU."""

from __future__ import annotations

import sys

import torch

__all__ = ["MemoryTracker"]


class MemoryTracker:
    """Peak memory of a stretch of work: CUDA max allocated on GPUs, the process's peak RSS on CPU.

    On Linux the RSS high-water mark is reset through ``/proc/self/clear_refs``, so each stretch is measured on its
    own; where that is not possible the peak is the process's peak so far (:attr:`resettable` is ``False``).

    Attributes:
        device: The device measured.
        resettable: Whether :meth:`reset` starts a fresh measurement.
        kind: What :meth:`peak` measures, in words.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.resettable = self.device.type == "cuda"
        self.kind = "CUDA max allocated" if self.device.type == "cuda" else "process peak RSS"

    def reset(self) -> None:
        """Start a new measurement."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        try:
            with open("/proc/self/clear_refs", "w") as handle:
                handle.write("5")  # 5 resets the peak RSS to the current RSS (proc(5), Linux 4.0+)
            self.resettable = True
        except OSError:
            self.resettable = False

    def peak(self) -> int | None:
        """Peak bytes since :meth:`reset` (``None`` where the platform cannot tell)."""
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        try:
            with open("/proc/self/status") as handle:
                for line in handle:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass  # not Linux: fall back to getrusage below
        if sys.platform == "win32":
            return None
        import resource

        scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss is bytes on macOS, KiB elsewhere
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * scale
