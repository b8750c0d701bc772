"""Peak RSS of a block of code, this process and its children, and CUDA's peaks when CUDA is in use.

`PeakMemory` samples the resident set of this process and its children in a background thread
(100 Hz by default, >= 20 Hz enforced), and on Linux also reads the kernel's exact high-water
mark of this process (VmHWM, reset on entry), so a peak shorter than one interval is not missed;
when this process has already started CUDA it reads torch's max allocated/reserved of one device
(`cuda_device`, default the current one), and never starts CUDA itself: a context started inside
an RSS measurement would add ~1.5 GB of RSS and ~0.5 GB of VRAM to it. Trade-off: children are only
sampled, so a child's millisecond spike can slip between samples; the thread costs < 1% of a core.
torch is imported only if it is already loaded, so measuring never drags torch into a process.
`synchronize` waits for a device's kernels before a clock is read.
"""
from __future__ import annotations

import sys
import threading

import psutil


class PeakMemory:
    """Context manager: peak RSS of process + children, and CUDA max allocated/reserved.

    with PeakMemory() as pm: work()
    pm.baseline, pm.peak, pm.delta (RSS bytes); pm.cuda_allocated_delta, pm.cuda_reserved_peak.
    """

    def __init__(self, interval_s: float = 0.01, include_children: bool = True, cuda_device=None):
        if not 0 < interval_s <= 0.05:
            raise ValueError(f"interval_s={interval_s} must be in (0, 0.05] (>= 20 Hz sampling)")
        self.interval_s = interval_s
        self.include_children = include_children
        self.cuda_device = cuda_device
        self.baseline = 0
        self.peak = 0
        self.samples = 0
        self.cuda_baseline: int | None = None
        self.cuda_allocated_peak: int | None = None
        self.cuda_reserved_peak: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._process = psutil.Process()

    @property
    def delta(self) -> int:
        """Peak RSS above the RSS at entry."""
        return self.peak - self.baseline

    @property
    def cuda_allocated_delta(self) -> int | None:
        """CUDA max allocated above what was allocated at entry (None without CUDA)."""
        if self.cuda_allocated_peak is None:
            return None
        return self.cuda_allocated_peak - self.cuda_baseline

    def rss(self) -> int:
        """RSS of this process plus, if asked, all its live children."""
        total = self._process.memory_info().rss
        if self.include_children:
            for child in self._process.children(recursive=True):
                try:
                    total += child.memory_info().rss
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    pass
        return total

    def __enter__(self) -> PeakMemory:
        torch = _cuda_torch()
        if torch is not None:
            device = self._device(torch)
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            self.cuda_baseline = torch.cuda.memory_allocated(device)
        self._hwm_reset = reset_peak_rss()
        self.baseline = self.peak = self.rss()
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, name="PeakMemory", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.rss())
        if self._hwm_reset:   # the kernel's exact high-water mark catches peaks between samples
            children = self.rss() - self._process.memory_info().rss
            self.peak = max(self.peak, peak_rss() + max(0, children))
        torch = _cuda_torch()
        if torch is not None and self.cuda_baseline is not None:
            device = self._device(torch)
            torch.cuda.synchronize(device)
            self.cuda_allocated_peak = torch.cuda.max_memory_allocated(device)
            self.cuda_reserved_peak = torch.cuda.max_memory_reserved(device)

    def _device(self, torch):
        """The CUDA device measured: the one given, else the current one (read once, then kept)."""
        if self.cuda_device is None:
            self.cuda_device = torch.device("cuda", torch.cuda.current_device())
        return torch.device(self.cuda_device)

    def _sample(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, self.rss())
                self.samples += 1
            except psutil.Error:
                pass
            self._stop.wait(self.interval_s)


def reset_peak_rss() -> bool:
    """Reset this process's VmHWM (Linux: write 5 to /proc/self/clear_refs); False if unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return peak_rss() > 0
    except OSError:
        return False


def peak_rss() -> int:
    """This process's peak RSS since the last reset (VmHWM), in bytes; 0 if unknown."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def synchronize(device) -> None:
    """Wait for `device`'s queued kernels (CUDA), so a clock read after it times the work; no-op on CPU.

    `device`: a torch.device or its name ("cuda:0", "cpu"). torch is imported inside, as everywhere here.
    """
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _cuda_torch():
    """torch, when it is already imported and this process has started CUDA; else None.

    is_initialized(), not is_available(): measuring CPU work in a process that never touched
    the GPU must not create a CUDA context (what synchronize() or reset_peak_memory_stats() do).
    """
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    return torch
