"""The subprocess behind `nblib.measure.encoder_peak`: build the encoder, warm up, measure two passes.

Run as `python -m nblib.measure._encoder_worker '<json payload>'`; prints one JSON line.
"""
from __future__ import annotations

import gc
import json
import sys
import time

from nblib.config import PipelineConfig
from nblib.malloc import pin_malloc_mmap_threshold
from nblib.measure.rss import PeakMemory
from nblib.measure.tensors import synchronize
from nblib.sdpa import sdpa_context


def _encoder_peak_worker(payload: str) -> dict:
    """In a fresh process: build the encoder, warm up, then measure two forward passes."""
    import torch

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


if __name__ == "__main__":
    print(json.dumps(_encoder_peak_worker(sys.argv[1])))
