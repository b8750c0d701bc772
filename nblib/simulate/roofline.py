"""A roofline over a simulated trace: each kernel's time on a GPU of nblib.budget.DEVICES.

A kernel takes max(FLOPs / peak rate, bytes / memory bandwidth): GEMM-like kernels (matmul,
attention, convolution) run at the tensor-core rate in fp16/bf16, at TF32 for fp32 convolutions
where the GPU has TF32 (cudnn.allow_tf32 is on by default; matmul's allow_tf32 is off), else at
the fp32 rate; everything else is bandwidth-bound. The sum is a ceiling no GPU beats: no launch
overheads, perfect overlap. It is not the T4's speed: that is nblib.t4_speed's range, drawn from
public T4 measurements with their sources. `calibrated_rate` carries a rate measured on one GPU to
another by the share of its own roofline it reached (benchmarks/gpu_report.py, on a real GPU).
"""
from __future__ import annotations

from dataclasses import dataclass

from nblib.budget.devices import Device, device_preset

LABEL = "simulated"
_HALF = ("float16", "bfloat16")


@dataclass(frozen=True)
class Roofline:
    """One batch's roofline time on a device, split by what bounds each kernel (simulated)."""

    device: str
    batch_size: int
    seconds: float
    compute_bound_s: float
    memory_bound_s: float
    flops: float
    bytes: float
    label: str = LABEL

    @property
    def samples_per_s(self) -> float:
        return self.batch_size / self.seconds if self.seconds else 0.0


def kernel_rate(kernel, device: Device) -> float:
    """Peak FLOP/s the kernel's math runs at on `device`."""
    if not kernel.tensor_core:
        return device.fp32_flops
    if kernel.dtype in _HALF:
        return device.fp16_flops
    if kernel.op.split(".")[0] in ("convolution", "_convolution") and device.tf32_flops:
        return device.tf32_flops
    return device.fp32_flops


def roofline(kernels, batch_size: int, device: str | Device) -> Roofline:
    """The roofline time of one batch's `kernels` (nblib.budget.trace.Kernel) on `device`."""
    dev = device_preset(device)
    total = compute = memory = 0.0
    for k in kernels:
        t_math = k.flops / kernel_rate(k, dev) if k.flops else 0.0
        t_mem = k.bytes / dev.memory_bandwidth
        total += max(t_math, t_mem)
        if t_math >= t_mem:
            compute += t_math
        else:
            memory += t_mem
    return Roofline(device=dev.name, batch_size=batch_size, seconds=total, compute_bound_s=compute,
                    memory_bound_s=memory, flops=float(sum(k.flops for k in kernels)),
                    bytes=float(sum(k.bytes for k in kernels)))


def calibrated_rate(target: Roofline, reference: Roofline, measured_samples_per_s: float) -> float:
    """Samples/s of `target` if it reaches the share of its roofline a measured `reference` run did.

    share = measured / reference roofline rate; the assumption (stated wherever the figure is
    shown) is that the share carries over from the measured precision to the target's.
    """
    share = measured_samples_per_s / reference.samples_per_s
    return target.samples_per_s * share
