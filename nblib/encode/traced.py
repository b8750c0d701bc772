"""The encode loop as the trace layer runs it (handed over at import: nblib.budget.traced_jobs).

On a fake cuda:0: the loop's input copy, the forward under inference_mode and autocast, and the run's own
`HostPart` (cast, then offload), so a VRAM budget follows an edit of the loop. torch is imported by a trace.
"""
from __future__ import annotations

from nblib.budget.model_vram import OUT_DTYPE
from nblib.budget.traced_jobs import batch_input, fake_device, hand_over, traced_figures

ENCODE_BATCHES = 2          # the second batch meets the first one's cached segments


def trace_encoding(loaded, b: int, payload: dict) -> dict:
    """The encode job at batch `b` on a fresh fake device (the module a copy: .to() replaces its parameters)."""
    import copy

    import torch

    from nblib.models.head import _image_size
    from nblib.sdpa import sdpa_context

    size = _image_size(loaded)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(payload["precision"])
    module = copy.deepcopy(loaded.module).eval()
    with fake_device(payload["cc"]) as trace, sdpa_context(payload.get("sdpa")):
        weights = encode_batches(trace, module, loaded, b, size, dtype, payload)
        resident = trace.allocator.allocated
        trace.mark("resident")
    return traced_figures(trace, weights, resident)


def encode_batches(trace, module, loaded, b: int, size: int, dtype, payload: dict) -> int:
    """As nblib.encode.run's loop, as many batches as reach the steady state: the input copy,
    the forward under inference_mode and autocast, and the run's own HostPart (the kept outputs cast to
    out_dtype on the device; offload "async", or "consolidate": `every` batches kept, concatenated, copied).
    Returns the bytes of the module's weights on the device.
    """
    import torch

    from nblib.models.outputs import named_outputs

    offload, every = payload.get("offload", "async"), payload.get("every", 1)
    batches = every + 2 if offload == "consolidate" else ENCODE_BATCHES
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
            host = simulated_host_part(shapes, b * batches, payload.get("out_dtype", OUT_DTYPE), batch[0].device,
                                       offload, every)
        host.add(outputs, i * b)
        del outputs
    host.finish()
    del batch
    return weights


def simulated_host_part(*args):
    """The run's HostPart with fake (unpinned) host buffers and no CUDA event: everything else is its own."""
    import torch

    from nblib.encode.offload import HostPart

    class SimulatedHostPart(HostPart):
        def _host_buffer(self, shape, dtype):
            return torch.empty(shape, dtype=dtype)

        def _mark_copied(self) -> None:
            pass

        def finish(self) -> None:
            self._flush_pending()

    return SimulatedHostPart(*args)


hand_over("encode", trace_encoding)
