"""The measured twin of the encoder's memory budget: one forward pass's peak, in a fresh subprocess.

A fresh process per measurement keeps one batch size's freed memory from hiding the next one's
growth; the worker (`_encoder_peak_worker`, run in `python -c`) prints one JSON line.
Trade-off: a process start and a model build per point (seconds), for numbers free of history.
"""
from __future__ import annotations

import json
import subprocess
import sys

WORKER = ("import json, sys\nfrom nblib.measure.encoder import _encoder_peak_worker\n"
          "print(json.dumps(_encoder_peak_worker(sys.argv[1])))")


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
    proc = subprocess.run([sys.executable, "-c", WORKER, payload], capture_output=True,
                          text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"encoder_peak worker failed (exit {proc.returncode}):\n"
                           f"{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _encoder_peak_worker(payload: str) -> dict:
    """In a fresh process: build the encoder, warm up, then measure two forward passes."""
    import gc
    import time

    import torch

    from nblib.config import PipelineConfig
    from nblib.malloc import pin_malloc_mmap_threshold
    from nblib.measure.rss import PeakMemory, synchronize
    from nblib.sdpa import sdpa_context
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
    cuda = device if device.type == "cuda" else None
    # one-time costs: GEMM workspaces sized for this batch
    with sdpa_context(args.get("sdpa_backend")), PeakMemory(cuda_device=cuda) as first:
        first_out = model.encode(images)
        synchronize(device)
    del first_out
    gc.collect()
    start = time.perf_counter()
    # steady state: what every later batch adds
    with sdpa_context(args.get("sdpa_backend")), PeakMemory(cuda_device=cuda) as pm:
        out = model.encode(images)
        synchronize(device)
    seconds = time.perf_counter() - start
    del out
    return {"batch_size": args["batch_size"], "device": args["device"], "rss_delta": pm.delta,
            "rss_delta_first": first.delta,
            "cuda_allocated_delta": pm.cuda_allocated_delta,
            "cuda_allocated_delta_first": first.cuda_allocated_delta,
            "cuda_reserved_peak": pm.cuda_reserved_peak, "seconds": seconds,
            "malloc_pinned": pinned}
