"""The encode loop's device side on a simulated GPU: input copy, forward, cast, offload.

`simulate_encode(config, gpu="t4")` builds the real `TRMVisionEncoder` on a fake CUDA device
(`nblib.budget.trace`) and runs the steps `nblib.encode.run` runs per batch, with the real
`HostPart` doing the cast and the offload in either mode: enough batches to reach the steady
state (three in "async", one consolidation and two more batches in "consolidate"). It returns
the simulated peaks (live tensors, allocated and reserved by the caching-allocator model), the
operator at the peak, and the kernels of one batch for the roofline. Every figure is simulated:
the CUDA context and real timing are outside what a simulation can see.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from nblib.budget.devices import Device, gpu_preset
from nblib.budget.memory import output_shapes
from nblib.config import PipelineConfig
from nblib.encode.traced import simulated_host_part
from nblib.errors import require_choice

LABEL = "simulated"
PRECISIONS = ("fp16", "fp32")
OFFLOAD_MODES = ("async", "consolidate")


@dataclass(frozen=True)
class SimulatedRun:
    """What the encode loop holds on a simulated GPU; every byte figure is simulated."""

    config: PipelineConfig
    gpu: str
    precision: str
    offload: str
    sdpa_backend: str           # the attention kernel the GPU ran
    batches: int                # batches simulated
    max_live: int               # peak bytes of live device tensors (exact storage sizes)
    max_allocated: int          # simulated torch.cuda.max_memory_allocated()
    max_reserved: int           # simulated torch.cuda.max_memory_reserved()
    weights: int                # bytes of the model on the device
    peak_op: str
    peak_shape: tuple
    kernels: tuple = field(default=(), repr=False)   # one batch's kernels (budget.trace.Kernel)
    label: str = LABEL

    @property
    def flops_per_image(self) -> float:
        return sum(k.flops for k in self.kernels) / self.config.run.batch_size


def simulate_encode(config: PipelineConfig, gpu: str | Device = "t4", *, precision: str = "fp16",
                    offload: str = "async", sdpa_backend: str | None = None,
                    batches: int | None = None) -> SimulatedRun:
    """Run the encode loop's device-side steps for `batches` batches on a simulated `gpu`."""
    from nblib.budget.shim import run_cublas_config
    from nblib.budget.trace import DeviceTrace, fake_cuda
    from nblib.trm import TRMVisionEncoder

    dev = gpu_preset(gpu)
    require_choice("precision", precision, PRECISIONS)
    require_choice("offload", offload, OFFLOAD_MODES)
    cfg, r, m = config, config.run, config.model
    every = r.consolidate_every if offload == "consolidate" else 1
    n = batches or (every + 2 if offload == "consolidate" else 3)
    encoder = TRMVisionEncoder(cfg.model, seed=r.seed).eval()
    encoder.set_inference(precision=precision, sdpa_backend=sdpa_backend)
    pixels = (r.batch_size, m.image_size, m.image_size, 3)
    with fake_cuda():
        # the run's cuBLAS workspace size: this process's CUBLAS_WORKSPACE_CONFIG, as the budget (encode_trace) reads it
        trace = DeviceTrace(dev.compute_capability, cublas_config=run_cublas_config(False))
        with trace:
            device = torch.device("cuda", 0)
            encoder.to(device)
            weights = trace.allocator.allocated
            shapes = {name: output_shapes(m)[name] for name in r.outputs}
            host = simulated_host_part(shapes, r.batch_size * n, r.out_dtype, device, offload, every)
            loaded = torch.empty(pixels, dtype=torch.uint8)          # the loader's host batch
            images = None
            kernels_before = 0
            for i in range(n):
                if i == n - 1:
                    kernels_before = len(trace.kernels)
                images = loaded.to(device, non_blocking=True)          # run.py: next(loader).to(device)
                host.add(encoder.encode(images), i * r.batch_size)
            kernels = tuple(trace.kernels[kernels_before:])
            host.finish()
            del images
    backend = max(trace.sdpa_used, key=trace.sdpa_used.get) if trace.sdpa_used else "none"
    peak = trace.peak
    return SimulatedRun(config=cfg, gpu=dev.name, precision=precision, offload=offload,
                        sdpa_backend=backend, batches=n, max_live=trace.max_live,
                        max_allocated=trace.allocator.max_allocated,
                        max_reserved=trace.allocator.max_reserved, weights=weights,
                        peak_op=peak.op, peak_shape=peak.shape, kernels=kernels)
