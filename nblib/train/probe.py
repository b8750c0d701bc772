"""Measure one training step in a fresh process: peak RSS, and whether it fits under a memory cap.

`step_peak(model, batch)` runs `python -m nblib.train.probe` in a subprocess (so the peak is this
step's, not the notebook's) with glibc's mmap threshold pinned (freed activations leave the RSS).
After one warm-up step at batch 1, it records the RSS, optionally caps new memory with RLIMIT_AS at
(address space now + cap), then runs two steps of the loop's own `train_step` at `batch`: an allocation
past the cap raises inside torch and is reported as "does not fit". On CUDA the cap is the whole reservation
(`torch.cuda.set_per_process_memory_fraction`) and the device peak `max_memory_reserved()`, reported apart
from the host's RSS. `saved_bytes` counts what autograd keeps for backward (unique storages).
Trade-off: RLIMIT_AS caps address space, not RSS; after the warm-up, new address space is new memory to
within the allocator's slack.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass

from nblib.config import ModelConfig
from nblib.errors import one_line


@dataclass(frozen=True)
class StepPeak:
    """One measured step: host RSS before it, host peak RSS during it (bytes), whether it fit under the cap,
    and on CUDA the device's peak reservation (torch.cuda.max_memory_reserved; 0 on CPU).
    """

    batch_size: int
    rss_before: int
    peak_rss: int
    fits: bool
    error: str = ""
    device_peak: int = 0

    @property
    def delta(self) -> int:
        return self.peak_rss - self.rss_before


def step_peak(model: ModelConfig, batch_size: int, *, n_classes: int = 12, cap_bytes: int | None = None,
              device: str = "cpu", precision: str = "fp32", timeout: float = 600.0) -> StepPeak:
    """Run two training steps at `batch_size` in a fresh process; its peak RSS (and fit under `cap_bytes`).

    cap_bytes: on CPU, new memory past the warm-up; on CUDA, all the device memory the process may reserve.
    """
    payload = json.dumps({"model": model.__dict__, "batch": batch_size, "classes": n_classes, "cap": cap_bytes,
                          "device": device, "precision": precision})
    done = subprocess.run([sys.executable, "-m", "nblib.train.probe", payload], capture_output=True, text=True,
                          timeout=timeout, env={"OMP_NUM_THREADS": "1", **os.environ})
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        return StepPeak(batch_size, 0, 0, False, (done.stderr.strip().splitlines() or ["killed"])[-1])
    return StepPeak(**json.loads(lines[-1]))


def probe_largest_batch(model: ModelConfig, cap_bytes: int, start: int, *, tries: int = 6, progress: bool = False,
                        **kwargs) -> list[StepPeak]:
    """Try batches from `start` (the budget's answer): up by 1.25x while they fit, down by 0.8x while not.
    `progress` shows a bar over the tries (each a fresh process).
    """
    from nblib.compare import progress_bar

    results, batch = [], max(1, start)
    bar = progress_bar(tries, "probing batches", "try", disable=not progress)
    for _ in range(tries):
        result = step_peak(model, batch, cap_bytes=cap_bytes, **kwargs)
        results.append(result)
        bar.update(1)
        fits = [r.batch_size for r in results if r.fits]
        fails = [r.batch_size for r in results if not r.fits]
        if fits and fails and min(fails) - max(fits) <= max(1, max(fits) // 16):
            break
        if result.fits:
            batch = int(batch * 1.25) if not fails else (batch + min(fails)) // 2
        else:
            batch = max(1, int(batch * 0.8)) if not fits else (batch + max(fits)) // 2
    bar.close()
    return results


def probed_interval(results: list[StepPeak]) -> tuple[int, int | None]:
    """(low, high): the largest batch that fits lies in low..high, as the probes bound it. low: the largest batch
    that ran (0: none); high: one below the smallest batch above it that did not (None: no such probe).
    """
    low = max((r.batch_size for r in results if r.fits), default=0)
    fails = [r.batch_size for r in results if not r.fits and r.batch_size > low]
    return low, (min(fails) - 1 if fails else None)


def saved_bytes(model: ModelConfig, batch_size: int, n_classes: int = 12) -> int:
    """Bytes of the unique storages autograd saves for backward in one forward of the Classifier."""
    import torch

    from nblib.train.model import Classifier

    net = Classifier(model, n_classes)
    images = torch.randint(0, 256, (batch_size, model.image_size, model.image_size, 3), dtype=torch.uint8)
    seen = {}

    def pack(tensor):
        if tensor.requires_grad or tensor.grad_fn is not None or not any(tensor is p for p in net.parameters()):
            storage = tensor.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    params = {p.untyped_storage().data_ptr() for p in net.parameters()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        net(images).sum()
    return sum(n for ptr, n in seen.items() if ptr not in params)


def _worker(payload: dict) -> dict:
    import resource

    import psutil
    import torch

    from nblib.measure import pin_malloc_mmap_threshold
    from nblib.measure.rss import peak_rss, reset_peak_rss

    pin_malloc_mmap_threshold()
    device, batch, cap = payload["device"], payload["batch"], payload["cap"]
    cuda = device.startswith("cuda")
    if cuda:           # set_device and the fraction take an index ("cuda" alone: the current GPU)
        index = torch.device(device).index
        index = torch.cuda.current_device() if index is None else index
        torch.cuda.set_device(index)
        if cap:        # before the first allocation: every reservation counts against it
            total = torch.cuda.get_device_properties(index).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, float(cap) / total), index)
    step = _steps(payload)
    step(2)
    rss_before = psutil.Process().memory_info().rss
    if cap and not cuda:
        limit = psutil.Process().memory_info().vms + int(cap)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    reset_peak_rss()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    try:
        step(batch)
        step(batch)
        fits, error = True, ""
    except (RuntimeError, MemoryError) as exc:     # CPU: allocator failure; CUDA: OutOfMemoryError
        fits, error = False, one_line(str(exc).splitlines()[0], 120)    # a cut says so ("...")
    device_peak = torch.cuda.max_memory_reserved() if cuda else 0
    if cuda:
        torch.cuda.empty_cache()
    return {"batch_size": batch, "rss_before": rss_before, "peak_rss": max(peak_rss(), rss_before),
            "fits": fits, "error": error, "device_peak": int(device_peak)}


def _steps(payload: dict):
    """step(b): the loop's `train_step` at batch b on the payload's model, device and precision."""
    import torch

    from nblib.train.config import TrainConfig
    from nblib.train.loop import train_step, training_objects
    from nblib.train.model import Classifier

    model, device, classes = ModelConfig(**payload["model"]), payload["device"], payload["classes"]
    config = TrainConfig(precision=payload["precision"], device=device, steps=10, warmup_steps=1)
    net = Classifier(model, classes, seed=config.seed, dropout=config.dropout).to(device)
    optimizer, scheduler, scaler = training_objects(net, config)

    def step(b: int) -> None:
        images = torch.randint(0, 256, (b, model.image_size, model.image_size, 3), dtype=torch.uint8)
        labels = torch.randint(0, classes, (b,))
        if device.startswith("cuda"):
            images, labels = images.pin_memory(), labels.pin_memory()
        batches = iter([(images, labels, torch.arange(b))])
        train_step(net, optimizer, scheduler, scaler, batches, config.replace(batch_size=b))

    return step


if __name__ == "__main__":
    print(json.dumps(_worker(json.loads(sys.argv[1]))), flush=True)
