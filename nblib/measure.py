"""Measure what nblib.budget predicts: peak RSS (children included), CUDA peaks, disk use, throughput.

`PeakMemory` samples the resident set of this process and its children in a background thread
(100 Hz by default, >= 20 Hz enforced), and on Linux also reads the kernel's exact high-water
mark of this process (VmHWM, reset on entry), so a peak shorter than one interval is not missed;
when CUDA is present it reads torch's max allocated/reserved. Trade-off: children are only
sampled, so a child's millisecond spike can slip between samples; the thread costs < 1% of a core. torch is imported
only if it is already loaded, so measuring never drags torch into a process.
"""
from __future__ import annotations

import os
import shutil
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil


class PeakMemory:
    """Context manager: peak RSS of process + children, and CUDA max allocated/reserved.

    with PeakMemory() as pm: work()
    pm.baseline, pm.peak, pm.delta (RSS bytes); pm.cuda_allocated_delta, pm.cuda_reserved_peak.
    """

    def __init__(self, interval_s: float = 0.01, include_children: bool = True):
        if not 0 < interval_s <= 0.05:
            raise ValueError(f"interval_s={interval_s} must be in (0, 0.05] (>= 20 Hz sampling)")
        self.interval_s = interval_s
        self.include_children = include_children
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
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.cuda_baseline = torch.cuda.memory_allocated()
        self._hwm_reset = _reset_peak_rss()
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
            self.peak = max(self.peak, _peak_rss() + max(0, children))
        torch = _cuda_torch()
        if torch is not None and self.cuda_baseline is not None:
            torch.cuda.synchronize()
            self.cuda_allocated_peak = torch.cuda.max_memory_allocated()
            self.cuda_reserved_peak = torch.cuda.max_memory_reserved()

    def _sample(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, self.rss())
                self.samples += 1
            except psutil.Error:
                pass
            self._stop.wait(self.interval_s)

    def report(self) -> str:
        parts = [f"RSS baseline {self.baseline / 1e6:.1f} MB, peak {self.peak / 1e6:.1f} MB "
                 f"(+{self.delta / 1e6:.1f} MB, {self.samples} samples)"]
        if self.cuda_allocated_peak is not None:
            parts.append(f"CUDA max allocated +{self.cuda_allocated_delta / 1e6:.1f} MB, "
                         f"max reserved {self.cuda_reserved_peak / 1e6:.1f} MB")
        return "; ".join(parts)


def disk_usage(folder: str | Path) -> int:
    """Bytes of all regular files under `folder` (0 if it does not exist)."""
    total = 0
    for root, _dirs, files in os.walk(folder):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except FileNotFoundError:   # removed while walking (a temporary renamed away)
                pass
    return total


def existing_parent(folder: str | Path) -> Path:
    """`folder` if it exists, else its nearest existing parent (a job's folder may not exist yet)."""
    path = Path(folder).expanduser().absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def disk_space(folder: str | Path) -> tuple[int, int]:
    """(total, free) bytes of the filesystem holding `folder` (or its nearest existing parent)."""
    usage = shutil.disk_usage(existing_parent(folder))
    return usage.total, usage.free


def disk_free(folder: str | Path) -> int:
    """Free bytes on the filesystem holding `folder` (or its nearest existing parent)."""
    return disk_space(folder)[1]


class DiskDelta:
    """Context manager: bytes a folder grew by (files under it) and free-disk change."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.before = self.after = 0
        self.free_before = self.free_after = 0

    @property
    def delta(self) -> int:
        return self.after - self.before

    def __enter__(self) -> DiskDelta:
        self.before, self.free_before = disk_usage(self.folder), disk_free(self.folder)
        return self

    def __exit__(self, *exc) -> None:
        self.after, self.free_after = disk_usage(self.folder), disk_free(self.folder)


@dataclass
class Throughput:
    """Samples/s over time: call `tick(n)` after each batch; `rate()` and `series()` read it."""

    window: int = 20
    start: float = field(default_factory=time.perf_counter)
    times: list[float] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)

    def tick(self, n_samples: int) -> None:
        self.times.append(time.perf_counter())
        self.counts.append((self.counts[-1] if self.counts else 0) + int(n_samples))

    @property
    def total(self) -> int:
        return self.counts[-1] if self.counts else 0

    def rate(self) -> float:
        """Samples/s over the last `window` ticks (over all ticks since start when fewer)."""
        if not self.times:
            return 0.0
        if len(self.times) <= self.window:
            elapsed, done = self.times[-1] - self.start, self.counts[-1]
        else:
            i = -self.window - 1
            elapsed, done = self.times[-1] - self.times[i], self.counts[-1] - self.counts[i]
        return done / elapsed if elapsed > 0 else 0.0

    def overall(self) -> float:
        """Samples/s since start."""
        elapsed = (self.times[-1] - self.start) if self.times else 0.0
        return self.total / elapsed if elapsed > 0 else 0.0

    def series(self) -> tuple[list[float], list[float]]:
        """(seconds since start, samples/s of each interval) for a throughput-over-time plot."""
        xs, ys, prev_t, prev_n = [], [], self.start, 0
        for t, n in zip(self.times, self.counts):
            if t > prev_t:
                xs.append(t - self.start)
                ys.append((n - prev_n) / (t - prev_t))
            prev_t, prev_n = t, n
        return xs, ys


def _reset_peak_rss() -> bool:
    """Reset this process's VmHWM (Linux: write 5 to /proc/self/clear_refs); False if unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _peak_rss() > 0
    except OSError:
        return False


def _peak_rss() -> int:
    """This process's peak RSS since the last reset (VmHWM), in bytes; 0 if unknown."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _cuda_torch():
    """torch, when it is already imported and has an initialized CUDA device; else None."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return None
    return torch


# ---------------------------------------------------------------------------- encoder peaks


class TensorPeak:
    """Context manager: exact peak bytes of torch tensors created inside it and still alive.

    A TorchDispatchMode sees every tensor an op returns and a finalizer sees its storage freed,
    so the peak is exact and independent of the allocator (no RSS noise, no CUDA cache). It
    misses buffers a kernel allocates internally and frees before returning.
    """

    def __init__(self):
        self.current = self.peak = 0
        self._live: dict[int, int] = {}
        self._mode = None

    def __enter__(self) -> TensorPeak:
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        tracker = self

        class _Track(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in tree_flatten(out)[0]:
                    if hasattr(t, "untyped_storage"):
                        tracker._add(t.untyped_storage())
                return out

        self._mode = _Track()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)

    def _add(self, storage) -> None:
        import weakref

        key, size = storage.data_ptr(), storage.nbytes()
        if size == 0 or key in self._live:
            return
        self._live[key] = size
        self.current += size
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.current -= self._live.pop(key, 0)



def pin_malloc_mmap_threshold(threshold_bytes: int = 256 * 1024) -> bool:
    """Make glibc serve buffers >= threshold with mmap, so freed activations leave the RSS.

    By default glibc raises its mmap threshold (up to 32 MB) each time a large block is freed;
    later blocks below it come from the heap and stay resident after they are freed, which
    inflates a CPU forward pass's peak RSS 1.5-1.7x over its live buffers. Pinning the
    threshold (mallopt M_MMAP_THRESHOLD) stops that. Returns False where glibc is absent.
    """
    import ctypes
    import ctypes.util

    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(-3, int(threshold_bytes)))  # -3: M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


def encoder_peak(config, batch_size: int, device: str = "cpu", *, seed: int = 0,
                 pin_malloc: bool = True, sdpa_backend: str | None = None,
                 timeout_s: float = 300) -> dict:
    """Peak memory of one encoder forward pass, measured in a fresh subprocess.

    Returns {"batch_size", "device", "rss_delta", "cuda_allocated_delta", "cuda_reserved_peak",
    "seconds", ...}: the steady-state increase of a second pass over the same batch, measured from
    the state after building the model, creating the uint8 batch and one full pass (so one-time
    GEMM workspaces are not counted); "rss_delta_first" / "cuda_allocated_delta_first" are the
    first pass's increase, with them. pin_malloc: see pin_malloc_mmap_threshold (the budget
    predicts live buffers; unpinned glibc adds its heap retention on top). A fresh process per
    measurement keeps one batch size's freed memory from hiding the next one's growth.
    sdpa_backend="math" forces PyTorch's math attention (materialized scores); None keeps the
    default choice (flash on CPU).
    """
    import json
    import subprocess

    payload = json.dumps({"config": config.to_dict(), "batch_size": int(batch_size),
                          "device": device, "seed": seed, "pin_malloc": pin_malloc,
                          "sdpa_backend": sdpa_backend})
    proc = subprocess.run([sys.executable, "-m", "nblib.measure", payload], capture_output=True,
                          text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"encoder_peak worker failed (exit {proc.returncode}):\n"
                           f"{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _encoder_peak_worker(payload: str) -> dict:
    """In a fresh process: build the encoder, warm up, then measure two forward passes."""
    import gc
    import json

    import torch

    from nblib.config import PipelineConfig
    from nblib.trm import TRMVisionEncoder

    args = json.loads(payload)
    pinned = args.get("pin_malloc", True) and pin_malloc_mmap_threshold()
    cfg = PipelineConfig.from_dict(args["config"])
    device = torch.device(args["device"])
    model = TRMVisionEncoder(cfg.model, seed=args["seed"]).eval().to(device)
    size = cfg.model.image_size
    gen = torch.Generator().manual_seed(args["seed"])
    warm = torch.randint(0, 256, (2, size, size, 3), dtype=torch.uint8, generator=gen).to(device)
    model.encode(warm)
    images = torch.randint(0, 256, (args["batch_size"], size, size, 3), dtype=torch.uint8,
                           generator=gen).to(device)
    del warm
    gc.collect()
    backend = _sdpa_context(args.get("sdpa_backend"))
    with backend, PeakMemory() as first:          # one-time costs: GEMM workspaces sized for this batch
        first_out = model.encode(images)
        _sync(device)
    del first_out
    gc.collect()
    start = time.perf_counter()
    with backend, PeakMemory() as pm:    # steady state: what every later batch adds
        out = model.encode(images)
        _sync(device)
    seconds = time.perf_counter() - start
    del out
    return {"batch_size": args["batch_size"], "device": args["device"], "rss_delta": pm.delta,
            "rss_delta_first": first.delta,
            "cuda_allocated_delta": pm.cuda_allocated_delta,
            "cuda_allocated_delta_first": first.cuda_allocated_delta,
            "cuda_reserved_peak": pm.cuda_reserved_peak, "seconds": seconds,
            "malloc_pinned": pinned}


def _sdpa_context(name: str | None):
    """A context forcing one SDPA backend ("math", "efficient", "flash"), or a no-op for None."""
    import contextlib

    if name is None:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kinds = {"math": SDPBackend.MATH, "efficient": SDPBackend.EFFICIENT_ATTENTION,
             "flash": SDPBackend.FLASH_ATTENTION}
    return _Reusable(lambda: sdpa_kernel(kinds[name]))


class _Reusable:
    """A context manager factory usable in several `with` statements."""

    def __init__(self, make):
        self.make, self.active = make, []

    def __enter__(self):
        self.active.append(self.make())
        return self.active[-1].__enter__()

    def __exit__(self, *exc):
        return self.active.pop().__exit__(*exc)


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


if __name__ == "__main__":
    import json

    print(json.dumps(_encoder_peak_worker(sys.argv[1])))
