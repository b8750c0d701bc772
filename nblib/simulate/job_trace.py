"""The child side of `nblib.budget.model_vram`: one job traced on a fake cuda:0, in a fresh process.

`model_vram` runs this module with `run_child` (the fake-CUDA shim loaded before torch). For
encoding it runs the encode loop's input copy, forward under inference_mode and autocast, and the
offload's cast; for training, `traced_train_step`: the loop's own module (`nblib.train.task.
loop_module`), `training_objects` and `train_step` (nblib.train.loop), so the budget, the simulated
step (nblib.simulate.train) and the model simulation (nblib.simulate.model) trace one step. Two
small batches give a line through every batch's allocation stream, checked against a third to the byte
(`nblib.budget.allocator.affine_stream`), which the child returns and `model_vram` replays at any batch and keeps;
a job that is not affine has each batch it is asked for, and each probe of the largest-batch search, traced here
itself. It lives in the simulation layer because it runs the jobs' code.
"""
from __future__ import annotations

import contextlib
import json
import sys

from nblib.budget.model_vram import OUT_DTYPE, largest_batch, token_length

TRAIN_STEPS = 3             # AdamW's moments exist from the first step: steps 2 and 3 are the steady state
ENCODE_BATCHES = 2          # the second batch meets the first one's cached segments


# the line through the first two traces is kept only where the third (far: a fake batch costs no more) is on it to
# the byte (affine_stream); a [B, B] tensor or a branch on the batch size up to 64 fails that: each batch is traced
TRACED_BATCHES = (2, 3, 64)


def _child(payload: dict) -> dict:
    from nblib.budget.shim import child_model

    loaded = child_model(payload)
    if "variants" in payload:      # the budget's cached traces (nblib.budget.encode_trace): specs of one model
        return {"entries": [_stream(loaded, {**payload, **variant})[:2] for variant in payload["variants"]]}
    traced = {}
    if payload.get("replay", True):             # False: trace each batch itself (the test of the replay)
        stream, peak_op, traced = _stream(loaded, payload)
        if stream is not None:                  # model_vram replays it at every batch (replayed_point)
            return {"stream": stream, "peak_op": peak_op,
                    "nondeterministic": traced[TRACED_BATCHES[1]]["nondeterministic"]}

    def point(b: int) -> dict:                  # not batch-affine: trace this batch itself
        if b not in traced:
            traced[b] = trace_job(loaded, b, payload)
        return {k: v for k, v in traced[b].items() if k != "events"}

    out = {"points": [point(b) for b in payload["batches"]], "stream": None,
           "nondeterministic": point(payload["batches"][-1])["nondeterministic"]}   # named before step 1
    if payload["search"]:
        out["largest"] = largest_batch(point, payload["cap"], payload["max_batch"])
    return out


def _stream(loaded, payload: dict) -> tuple:
    """(affine stream or None, the op at the peak, {batch: trace}): the job traced at TRACED_BATCHES."""
    from nblib.budget.allocator import affine_stream

    traced = {b: trace_job(loaded, b, payload) for b in TRACED_BATCHES}
    stream = affine_stream({b: t["events"] for b, t in traced.items()})
    return stream, traced[TRACED_BATCHES[1]]["peak_op"], traced


def trace_job(loaded, b: int, payload: dict) -> dict:
    """One job (encode batches or training steps) at batch `b` on a fresh fake device: the traced figures."""
    import copy

    import torch

    from nblib.models.head import _image_size
    from nblib.sdpa import sdpa_context
    from nblib.train.determinism import documented_in
    from nblib.train.task import loop_module

    size = _image_size(loaded)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(payload["precision"])
    # a copy per trace: .to() on a fake device replaces the parameters with fake tensors
    if payload["train"]:        # the module the loop runs (the TRM's Classifier: its no_grad cycles included)
        module = copy.deepcopy(loop_module(loaded, payload["classes"], payload["output"], size))
        trace, weights, resident = traced_train_step(module, b, size, payload["precision"], payload["cc"])
    else:
        module = copy.deepcopy(loaded.module).eval()
        with fake_device(payload["cc"]) as trace, sdpa_context(payload.get("sdpa")):
            weights = encode_batches(trace, module, loaded, b, size, dtype, payload)
            resident = trace.allocator.allocated
            trace.mark("resident")
    ws = trace.workspace_bytes          # one per cuBLAS handle that ran a GEMM (nblib.budget.trace)
    by_pos = trace.reserved_by_position()
    return {"weights": weights, "resident": resident, "workspace": ws, "events": trace.events,
            "max_allocated": trace.allocator.max_allocated, "reserved_pytorch": trace.allocator.max_reserved,
            "reserved": by_pos, "peak_op": trace.peak.op if trace.peak else "",
            "nondeterministic": documented_in(trace.kernels) if payload["train"] else []}


def encode_batches(trace, module, loaded, b: int, size: int, dtype, payload: dict, n: int | None = None) -> int:
    """As nblib.encode.run's loop, `n` batches (default: as many as reach the steady state): the input copy,
    the forward under inference_mode and autocast, and the run's own HostPart (the kept outputs cast to
    out_dtype on the device; offload "async", or "consolidate": `every` batches kept, concatenated, copied).
    Returns the bytes of the module's weights on the device.
    """
    import torch

    from nblib.models.outputs import named_outputs
    from nblib.simulate.encode import _SimulatedHostPart

    offload, every = payload.get("offload", "async"), payload.get("every", 1)
    batches = n or (every + 2 if offload == "consolidate" else ENCODE_BATCHES)
    host_batch, call = batch_input(loaded, b, size, payload.get("inputs", "images"))
    module.to("cuda:0")
    weights = trace.allocator.allocated
    trace.mark("weights")
    host = None
    for i in range(batches):
        # a batch's inputs stay on the device through its forward, until the next batch's copy has landed
        batch = [t.to("cuda:0") for t in host_batch]
        with torch.inference_mode(), torch.autocast("cuda", dtype=dtype or torch.float32, enabled=dtype is not None):
            named = named_outputs(call(module, *batch))
        outputs = {n: named[n] for n in payload.get("outputs") or named}   # EncodeModel keeps the run's outputs
        del named
        if host is None:
            shapes = {n: tuple(t.shape[1:]) for n, t in outputs.items()}
            host = _SimulatedHostPart(shapes, b * batches, payload.get("out_dtype", OUT_DTYPE), batch[0].device,
                                      offload, every)
        host.add(outputs, i * b)
        del outputs
    host.finish()
    del batch
    return weights


def batch_input(loaded, b: int, size: int, inputs: str) -> tuple:
    """(the batch as the host holds it, call(module, *batch on the device)): uint8 [b, size, size, 3] images
    through the model's preprocessing, or for "tokens:LENGTH" (nblib.budget.model_vram.token_length) int64
    input_ids and attention_mask of [b, LENGTH] as keywords (a BERT-style encoder; the mask as a padded batch
    has it, so the attention runs masked).
    """
    import torch

    length = token_length(inputs)
    if length is None:
        return [torch.empty((b, size, size, 3), dtype=torch.uint8)], \
            lambda module, images: module(loaded.preprocessing.apply(images))
    ids, mask = torch.zeros((b, length), dtype=torch.int64), torch.ones((b, length), dtype=torch.int64)
    return [ids, mask], lambda module, ids, mask: module(input_ids=ids, attention_mask=mask)


@contextlib.contextmanager
def fake_device(cc: int):
    """A fresh fake cuda:0 of compute capability `cc` (in a child process with the shim, `run_child`): the trace
    of every storage through the allocator model, attention as the GPU's kernel takes it, bf16 autocast allowed.
    """
    from unittest import mock

    import torch

    from nblib.budget.trace import attention_as_on_gpu, fake_cuda, step_trace_class

    with fake_cuda(), mock.patch("torch.cuda.is_bf16_supported", return_value=True), \
            torch.autograd.set_multithreading_enabled(False):
        trace = step_trace_class()(cc)
        with trace, attention_as_on_gpu(trace):
            yield trace


def traced_train_step(net, b: int, size: int, precision: str, cc: int, steps: int = TRAIN_STEPS,
                      before_last=None):
    """(trace, weights' bytes, bytes held between steps): the one traced training step. `net` (the loop's
    module, `nblib.train.task.loop_module`) on a fake cuda:0, then `steps` calls of the loop's own `train_step`
    with its `training_objects` (nblib.train.loop) at batch `b` of uint8 [b, size, size, 3] images.
    before_last(trace, optimizer, scaler): a context manager entered around the last step (the simulation's
    audit).
    """
    import torch

    from nblib.train.config import TrainConfig
    from nblib.train.loop import train_step, training_objects

    config = TrainConfig(batch_size=b, precision=precision, device="cuda:0", steps=steps + 1, warmup_steps=1)
    indices = torch.arange(b)              # real: the loop logs them with .tolist()

    def batches():                         # what the loop's DataLoader yields
        while True:
            yield (torch.empty((b, size, size, 3), dtype=torch.uint8), torch.zeros(b, dtype=torch.int64), indices)

    stream = batches()
    with fake_device(cc) as trace:
        net.train().to(config.device)
        weights = trace.allocator.allocated
        trace.mark("weights")
        optimizer, scheduler, scaler = training_objects(net, config)
        for k in range(steps):
            last = k == steps - 1 and before_last is not None
            with before_last(trace, optimizer, scaler) if last else contextlib.nullcontext():
                train_step(net, optimizer, scheduler, scaler, stream, config)
        trace.mark("resident")             # the optimizer's state is alive here: between steps
        resident = trace.allocator.allocated
    return trace, weights, resident


if __name__ == "__main__":
    print(json.dumps(_child(json.loads(sys.argv[1]))), flush=True)
