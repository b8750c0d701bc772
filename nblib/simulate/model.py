"""Any model's encode loop or training step on the simulated GPU: the jobs' own code, not the budget's.

`simulate_model(spec, batch_size, train=False)` runs, in a fresh process with the fake-CUDA shim
(nblib.budget.shim), what the jobs run (the jobs they hand to the trace layer, `traced_point`): encoding, the
batches of input copy, forward under inference_mode and autocast, and the encode loop's own `HostPart` (cast,
offload, async: nblib.encode.traced); training, the budget's own traced step (`nblib.train.traced.
traced_train_step`: nblib.train's `train_step` with its `training_objects` on the loop's module,
`nblib.train.task.loop_module`). Every storage goes through the caching-allocator model in PyTorch's order. The
budget (nblib.budget.model_vram) traces small batches and extrapolates; this twin runs the job at the batch itself.
Every figure is simulated.
"""
from __future__ import annotations

from dataclasses import dataclass

from nblib.budget.devices import Device, gpu_preset
from nblib.budget.model_vram import model_payload, traced_point

LABEL = "simulated"


@dataclass(frozen=True)
class SimulatedModelRun:
    """Simulated peaks of one model's job on a GPU (no CUDA context)."""

    spec: str
    batch_size: int
    precision: str
    train: bool
    max_allocated: int
    max_reserved: int
    label: str = LABEL


def simulate_model(model, batch_size: int, gpu: str | Device = "t4", *, precision: str = "fp16",
                   train: bool = False, n_classes: int = 12, output: str | None = None,
                   timeout_s: float = 600.0) -> SimulatedModelRun:
    """The simulated max allocated / reserved of `model`'s encode loop or training step at `batch_size`."""
    import nblib.encode.traced  # noqa: F401  the jobs hand themselves to the trace layer
    import nblib.train.traced  # noqa: F401

    dev = gpu_preset(gpu)
    job = {**model_payload(model), "precision": precision, "train": train, "classes": n_classes, "output": output,
           "cc": dev.compute_capability}
    point = traced_point(job, batch_size, timeout_s)
    return SimulatedModelRun(job["spec"], batch_size, precision, train, point["max_allocated"],
                             point["reserved_pytorch"])
