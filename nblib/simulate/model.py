"""Any model's encode loop or training step on the simulated GPU: the jobs' own code, not the budget's.

`simulate_model(spec, batch_size, train=False)` runs, in a fresh process with the fake-CUDA shim
(nblib.budget.shim), what the jobs run: encoding, three batches of input copy, forward under
inference_mode and autocast, and the encode loop's own `HostPart` (cast, offload, async); training,
the budget's own traced step (`nblib.train.traced.traced_train_step`: nblib.train's `train_step`
with its `training_objects` on the loop's module, `nblib.train.task.loop_module`). Every storage goes
through the caching-allocator model in PyTorch's order. The budget (nblib.budget.model_vram) traces
two small batches and extrapolates; this twin runs the job at the batch itself.
Every figure is simulated.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass

from nblib.budget.devices import Device, gpu_preset
from nblib.budget.model_vram import model_payload
from nblib.budget.shim import run_child

LABEL = "simulated"
BATCHES = 3


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
    dev = gpu_preset(gpu)
    payload = {**model_payload(model), "batch": batch_size, "precision": precision, "train": train,
               "classes": n_classes, "output": output, "cc": dev.compute_capability}
    out = run_child(__name__, payload, timeout_s=timeout_s)
    return SimulatedModelRun(payload["spec"], batch_size, precision, train, out["max_allocated"],
                             out["max_reserved"])


def _child(payload: dict) -> dict:
    from nblib.budget.shim import child_model

    loaded = child_model(payload)
    import torch

    from nblib.budget.traced_jobs import fake_device
    from nblib.encode.traced import encode_batches
    from nblib.models.head import _image_size
    from nblib.train.task import loop_module
    from nblib.train.traced import traced_train_step

    size, b = _image_size(loaded), payload["batch"]
    if payload["train"]:                   # the budget's traced step, at the batch itself
        net = loop_module(loaded, payload["classes"], payload["output"], size)
        trace, _, _ = traced_train_step(net, b, size, payload["precision"], payload["cc"], BATCHES)
    else:
        dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(payload["precision"])
        with fake_device(payload["cc"]) as trace:     # the budget's encode loop, run at the batch itself
            encode_batches(trace, loaded.module, loaded, b, size, dtype, payload, BATCHES)
    return {"max_allocated": trace.allocator.max_allocated, "max_reserved": trace.allocator.max_reserved}


if __name__ == "__main__":
    print(json.dumps(_child(json.loads(sys.argv[1]))), flush=True)
