"""Any model's encode loop or training step on the simulated GPU: the jobs' own code, not the budget's.

`simulate_model(spec, batch_size, train=False)` runs, in a fresh process with the fake-CUDA shim
(nblib.budget.shim), what the jobs run: encoding, three batches of input copy, forward under
inference_mode and autocast, and the encode loop's own `HostPart` (cast, offload, async); training,
three calls of nblib.train's `train_step` with its `training_objects` (AdamW, LR schedule,
GradScaler) on the model with a head (nblib.models.head). Every storage goes through the
caching-allocator model in PyTorch's order. The budget (nblib.budget.model_vram) traces its own
lighter job and extrapolates between two batches; this twin runs the loop at the batch itself.
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
    out = run_child("nblib.simulate.model", payload, timeout_s=timeout_s)
    return SimulatedModelRun(payload["spec"], batch_size, precision, train, out["max_allocated"],
                             out["max_reserved"])


def _child(payload: dict) -> dict:
    from nblib.budget.shim import child_model

    loaded = child_model(payload)
    from unittest import mock

    import torch

    from nblib.budget.trace import attention_as_on_gpu, fake_cuda, step_trace_class
    from nblib.models.head import _image_size, with_head
    size, b = _image_size(loaded), payload["batch"]
    net = with_head(loaded, payload["classes"], payload["output"], image_size=size) if payload["train"] else None
    with fake_cuda(), mock.patch("torch.cuda.is_bf16_supported", return_value=True), \
            torch.autograd.set_multithreading_enabled(False):
        trace = step_trace_class()(payload["cc"])
        with trace, attention_as_on_gpu(trace):
            if payload["train"]:
                _train(net, b, size, payload)
            else:
                _encode(loaded, b, size, payload)
    return {"max_allocated": trace.allocator.max_allocated, "max_reserved": trace.allocator.max_reserved}


def _train(net, b: int, size: int, payload: dict) -> None:
    import torch

    from nblib.train.config import TrainConfig
    from nblib.train.loop import train_step, training_objects

    config = TrainConfig(batch_size=b, precision=payload["precision"], device="cuda:0", steps=BATCHES + 1,
                         warmup_steps=1)
    net.to(config.device).train()
    optimizer, scheduler, scaler = training_objects(net, config)

    def batches():
        while True:
            yield (torch.empty((b, size, size, 3), dtype=torch.uint8), torch.zeros(b, dtype=torch.int64),
                   torch.arange(b))

    stream = batches()
    for _ in range(BATCHES):
        train_step(net, optimizer, scheduler, scaler, stream, config)


def _encode(loaded, b: int, size: int, payload: dict) -> None:
    import torch

    from nblib.models.outputs import named_outputs
    from nblib.simulate.encode import _SimulatedHostPart

    device = torch.device("cuda", 0)
    loaded.module.to(device)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(payload["precision"])
    host, shapes, loaded_batch = None, None, torch.empty((b, size, size, 3), dtype=torch.uint8)
    for i in range(BATCHES):
        images = loaded_batch.to(device, non_blocking=True)
        with torch.inference_mode(), torch.autocast("cuda", dtype=dtype or torch.float32, enabled=dtype is not None):
            outputs = named_outputs(loaded.module(loaded.preprocessing.apply(images)))
        if host is None:
            shapes = {name: tuple(t.shape[1:]) for name, t in outputs.items()}
            host = _SimulatedHostPart(shapes, b * BATCHES, "float16", device, "async", 1)
        host.add(outputs, i * b)
        del outputs             # as nblib.encode.run's loop: the images live until the next batch's copy lands
    host.finish()


if __name__ == "__main__":
    print(json.dumps(_child(json.loads(sys.argv[1]))), flush=True)
