"""The measured twin of the encoder's memory budget: one forward pass's peak, in a fresh subprocess.

A fresh process per measurement keeps one batch size's freed memory from hiding the next one's
growth; the worker (`nblib.measure._encoder_worker`, run with `python -m`) prints one JSON line.
Trade-off: a process start and a model build per point (seconds), for numbers free of history.
"""
from __future__ import annotations

import json
import subprocess
import sys

WORKER_MODULE = "nblib.measure._encoder_worker"


def encoder_peak(config, batch_size: int, device: str = "cpu", *, seed: int = 0,
                 pin_malloc: bool = True, sdpa_backend: str | None = None,
                 timeout_s: float = 300) -> dict:
    """Peak memory of one encoder forward pass, measured in a fresh subprocess.

    Returns {"batch_size", "device", "rss_delta", "cuda_allocated_delta", "cuda_reserved_peak",
    "seconds", ...}: the steady-state increase of a second pass over the same batch, measured from
    the state after building the model, creating the uint8 batch and one full pass (so one-time
    GEMM workspaces are not counted); "rss_delta_first" / "cuda_allocated_delta_first" are the
    first pass's increase, with them. pin_malloc: see pin_malloc_mmap_threshold (the budget
    predicts live buffers; unpinned glibc adds its heap retention on top).
    sdpa_backend="math" forces PyTorch's math attention (materialized scores); None keeps the
    default choice (flash on CPU).
    """
    payload = json.dumps({"config": config.to_dict(), "batch_size": int(batch_size),
                          "device": device, "seed": seed, "pin_malloc": pin_malloc,
                          "sdpa_backend": sdpa_backend})
    proc = subprocess.run([sys.executable, "-m", WORKER_MODULE, payload], capture_output=True,
                          text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"encoder_peak worker failed (exit {proc.returncode}):\n"
                           f"{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])
