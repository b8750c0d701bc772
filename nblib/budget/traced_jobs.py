"""The trace layer's job children: a job hands itself over, the budget asks for it, a child process runs it.

A traced job is a top-level function `job(loaded, b, payload) -> dict` (`traced_figures` of batch `b` on a fresh
fake cuda:0). nblib.encode and nblib.train hand theirs over when imported (`hand_over`), so the budget below them
asks for a job by its kind (`job_for`) and never names the code it traces. `run_job` runs it in the shim's child
(nblib.budget.shim.run_child, a fork of the warm process) by the reference read from the function. Three batches
give a line through the job's allocation stream, kept only where the third is on it to the byte (allocator.
affine_stream), which the caller replays at any batch; otherwise each batch asked for, and each probe of the
largest-batch search, is traced here. Trade-off: a process that imported neither job's package is refused, in
one line naming the import.
"""
from __future__ import annotations

import contextlib
import importlib
import json
import sys
from collections.abc import Callable

from nblib.budget.resources import largest_fitting
from nblib.budget.shim import child_model, run_child
from nblib.errors import ConfigError

# the line through the first two traces is kept only where the third (far: a fake batch costs no more) is on it to
# the byte (affine_stream); a [B, B] tensor or a branch on the batch size up to 64 fails that: each batch is traced
TRACED_BATCHES = (2, 3, 64)
_JOBS: dict[str, Callable] = {}          # kind ("encode", "train") -> the job its package handed over


def hand_over(kind: str, job: Callable) -> Callable:
    """A job's package gives the trace layer its traced job (a top-level function) for `kind`; returns `job`."""
    _JOBS[kind] = job
    return job


def job_for(kind: str) -> Callable:
    """The traced job handed over for `kind`; ConfigError naming the import that hands it over when none was."""
    if kind not in _JOBS:
        raise ConfigError(f"no {kind} job was handed to the trace layer in this process: import nblib.{kind} (the "
                          f"package whose job it is) before asking for its budget")
    return _JOBS[kind]


def run_job(job: Callable, payload: dict, timeout_s: float = 600.0) -> dict:
    """`_child` of `payload` with `job` in a child process (the shim loaded before torch): its result."""
    return run_child(__name__, {**payload, "job": [job.__module__, job.__qualname__]}, timeout_s=timeout_s)


def largest_batch(point, cap: int, max_batch: int) -> int:
    """The largest batch whose reserved VRAM, at the worst workspace position, stays within `cap`
    (nblib.budget.model_vram.reserved_cap), by `largest_fitting`; `point(b)`: a traced or replayed point.
    """
    return largest_fitting(lambda b: max(point(b)["reserved"].values()) <= cap, max_batch)


def traced_figures(trace, weights: int, resident: int, nondeterministic=()) -> dict:
    """What a job reports of its ended trace: weights, what stays between batches or steps, the cuBLAS workspaces,
    the allocation stream, the peaks, reserved memory at each workspace position, the ops torch documents as
    nondeterministic that it ran.
    """
    return {"weights": weights, "resident": resident, "workspace": trace.workspace_bytes, "events": trace.events,
            "max_allocated": trace.allocator.max_allocated, "reserved_pytorch": trace.allocator.max_reserved,
            "reserved": trace.reserved_by_position(), "peak_op": trace.peak.op if trace.peak else "",
            "nondeterministic": list(nondeterministic)}


def token_length(inputs: str) -> int | None:
    """The length of a "tokens:LENGTH" input (None for "images"); ConfigError for another form."""
    kind, _, length = str(inputs).partition(":")
    if kind == "images" and not length:
        return None
    if kind == "tokens" and length.isdigit() and int(length) > 0:
        return int(length)
    raise ConfigError(f"input {inputs!r} is not one the budget knows; write images (the default) or tokens:LENGTH "
                      f"(input_ids and attention_mask of LENGTH tokens, e.g. tokens:128)")


def batch_input(loaded, b: int, size: int, inputs: str) -> tuple:
    """(the batch as the host holds it, call(module, *batch on the device)): uint8 [b, size, size, 3] images
    through the model's preprocessing, or for "tokens:LENGTH" (`token_length`) int64 input_ids and attention_mask
    packed as [b, 2, LENGTH] (encode --records' batch: nblib.encode.token_records), called as keywords (a
    BERT-style encoder; the mask as a padded batch has it, so the attention runs masked).
    """
    import torch

    length = token_length(inputs)
    if length is None:
        return [torch.empty((b, size, size, 3), dtype=torch.uint8)], \
            lambda module, images: module(loaded.preprocessing.apply(images))
    tokens = torch.ones((b, 2, length), dtype=torch.int64)
    tokens[:, 0] = 0
    return [tokens], call_on_tokens


def call_on_tokens(module, tokens):
    """A text encoder called on int64 [B, 2, LENGTH] (ids, then the mask): `batch_input`'s call, and encode's."""
    return module(input_ids=tokens[:, 0], attention_mask=tokens[:, 1])


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


# ---------------------------------------------------------------- the child process
def _child(payload: dict) -> dict:
    """In the child: the model (shim first), then the job the payload names at the batches it asks for."""
    loaded = child_model(payload)
    module, name = payload["job"]
    job = importlib.import_module(module)
    for part in name.split("."):
        job = getattr(job, part)
    if "variants" in payload:      # the budget's cached traces (nblib.budget.encode_trace): specs of one model
        return {"entries": [_stream(job, loaded, {**payload, **variant})[:2] for variant in payload["variants"]]}
    traced = {}
    if payload.get("replay", True):             # False: trace each batch itself (the test of the replay)
        stream, peak_op, traced = _stream(job, loaded, payload)
        if stream is not None:                  # model_vram replays it at every batch (replayed_point)
            return {"stream": stream, "peak_op": peak_op,
                    "nondeterministic": traced[TRACED_BATCHES[1]]["nondeterministic"]}

    def point(b: int) -> dict:                  # not batch-affine: trace this batch itself
        if b not in traced:
            traced[b] = job(loaded, b, payload)
        return {k: v for k, v in traced[b].items() if k != "events"}

    out = {"points": [point(b) for b in payload["batches"]], "stream": None,
           "nondeterministic": point(payload["batches"][-1])["nondeterministic"]}   # named before step 1
    if payload["search"]:
        out["largest"] = largest_batch(point, payload["cap"], payload["max_batch"])
    return out


def _stream(job, loaded, payload: dict) -> tuple:
    """(affine stream or None, the op at the peak, {batch: trace}): the job traced at TRACED_BATCHES."""
    from nblib.budget.allocator import affine_stream

    traced = {b: job(loaded, b, payload) for b in TRACED_BATCHES}
    stream = affine_stream({b: t["events"] for b, t in traced.items()})
    return stream, traced[TRACED_BATCHES[1]]["peak_op"], traced


if __name__ == "__main__":
    print(json.dumps(_child(json.loads(sys.argv[1]))), flush=True)
