"""The training step as the trace layer runs it (handed over at import: nblib.budget.traced_jobs).

The loop's module (`task.loop_module`) and its own `training_objects` and `train_step` on a fake cuda:0, which
the simulated T4 runs too; the kernels name the documented nondeterministic ops. torch is imported by a trace.
"""
from __future__ import annotations

import contextlib

from nblib.budget.traced_jobs import fake_device, hand_over, traced_figures

TRAIN_STEPS = 3             # AdamW's moments exist from the first step: steps 2 and 3 are the steady state


def trace_training(loaded, b: int, payload: dict) -> dict:
    """The training job at batch `b` on a fresh fake device (the module a copy: .to() replaces its parameters): the
    image loop's (`loop_module`), or with payload["record"] a `train --records` run's (`record_batch`).
    """
    import copy

    from nblib.models.head import _image_size

    from .determinism import documented_in
    from .task import loop_module

    if payload.get("record"):
        from .records import RecordNet

        module = copy.deepcopy(RecordNet(loaded.module, payload["output"]))
        trace, weights, resident = traced_train_step(module, b, 0, payload["precision"], payload["cc"],
                                                     batch=record_batch(payload["record"], b),
                                                     loss_fn=record_loss(payload["record"]))
    else:
        size = _image_size(loaded)
        module = copy.deepcopy(loop_module(loaded, payload["classes"], payload["output"], size))
        trace, weights, resident = traced_train_step(module, b, size, payload["precision"], payload["cc"])
    return traced_figures(trace, weights, resident, documented_in(trace.kernels))


def record_batch(record: dict, b: int) -> tuple:
    """A padded `train --records` batch of `b` records as collate_records gives it, every record of the longest
    shape: (inputs, [target,] target lengths, input lengths). record: {"input": [shape, dtype], "target": [shape,
    dtype] or None (class labels of the output's rows, made by `record_loss`), "loss": "ce" or "mse"}.
    """
    import torch

    def rows(shape):
        return torch.full((b,), int(shape[0]) if shape else 1)

    (in_shape, in_dtype), target = record["input"], record.get("target")
    inputs = torch.zeros((b, *in_shape), dtype=getattr(torch, in_dtype))
    if target is None:
        return inputs, rows(in_shape), rows(in_shape)
    return inputs, torch.zeros((b, *target[0]), dtype=getattr(torch, target[1])), rows(target[0]), rows(in_shape)


def record_loss(record: dict):
    """The loss of a `train --records` step (nblib.train.records.masked_loss) on a `record_batch`."""
    import torch

    from .records import masked_loss

    def loss(net, inputs, *rest):
        *target, lengths, in_lengths = rest
        output = net(inputs, in_lengths)
        target = target[0] if target else output.new_zeros(output.shape[:-1], dtype=torch.int64)
        return masked_loss(output, target, lengths, record["loss"], checked=False)

    return loss


def traced_train_step(net, b: int, size: int, precision: str, cc: int, steps: int = TRAIN_STEPS,
                      before_last=None, batch: tuple | None = None, loss_fn=None):
    """(trace, weights' bytes, bytes held between steps): the one traced training step. `net` (the loop's
    module, `nblib.train.task.loop_module`) on a fake cuda:0, then `steps` calls of the loop's own `train_step`
    with its `training_objects` (nblib.train.loop) at batch `b` of uint8 [b, size, size, 3] images, or of the
    host tensors `batch` with `loss_fn` (a task's loss: train_step's).
    before_last(trace, optimizer, scaler): a context manager entered around the last step (the simulation's
    audit).
    """
    import torch

    from .config import TrainConfig
    from .loop import train_step, training_objects

    config = TrainConfig(batch_size=b, precision=precision, device="cuda:0", steps=steps + 1, warmup_steps=1)
    indices = torch.arange(b)              # real: the loop logs them with .tolist()

    if batch is None:
        batch = (torch.empty((b, size, size, 3), dtype=torch.uint8), torch.zeros(b, dtype=torch.int64))

    def batches():                         # what the loop's DataLoader yields
        while True:
            yield (*batch, indices)

    stream = batches()
    with fake_device(cc) as trace:
        net.train().to(config.device)
        weights = trace.allocator.allocated
        trace.mark("weights")
        optimizer, scheduler, scaler = training_objects(net, config)
        for k in range(steps):
            last = k == steps - 1 and before_last is not None
            with before_last(trace, optimizer, scaler) if last else contextlib.nullcontext():
                train_step(net, optimizer, scheduler, scaler, stream, config, loss_fn)
        trace.mark("resident")             # the optimizer's state is alive here: between steps
        resident = trace.allocator.allocated
    return trace, weights, resident


hand_over("train", trace_training)
