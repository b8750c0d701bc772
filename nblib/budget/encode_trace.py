"""The VRAM of a TRM encode job: the one trace (nblib.budget.model_vram's child), cached so a budget is instant.

`encode_vram(config, device, ...)` is what `predict_budget` prints for VRAM on a GPU: the trace of the encode
loop (the job nblib.encode hands to the trace layer: input copy, forward under autocast, the run's HostPart) at
the config's batch, the same `ModelVRAM` `budget --model` prints. A trace needs torch and takes seconds; the
sliders, plans and advice ask for dozens of batches. The trace's allocation stream is affine in the batch (every
storage is numel x itemsize: `nblib.budget.allocator.affine_stream`, measured, not assumed: the traced streams at
batches 16 and 64 equal it), while the VRAM it gives is not (512 B rounding, 2 MiB segments, best fit): so the
cache keeps the stream, not a formula, and any batch is a replay of it through the allocator model, in pure
Python.
The streams of the suite's own configs (and 01's largest batch on the other GPUs) ship in `nblib/trace_seed/`
(JSON, keyed by the spec, torch's major.minor, the trace format and the variables that shape a trace:
nblib.budget.trace_store); `tests/test_encode_trace.py` traces them again and compares the files to the byte
(`tests/trace_table.py` writes them). A spec not in the table, or traced under another torch, is traced once and
kept in the user's trace cache (trace_store).
"""
from __future__ import annotations

import json
from dataclasses import replace
from functools import lru_cache

from nblib.budget import trace_store
from nblib.budget.allocator import cublas_workspace_bytes, warn_if_not_native
from nblib.budget.devices import Device, device_preset
from nblib.budget.memory import Line
from nblib.budget.model_vram import ModelVRAM, _budget, model_payload, replayed_point
from nblib.budget.shim import run_cublas_config
from nblib.budget.traced_jobs import job_for, run_job
from nblib.config import PipelineConfig
from nblib.units import fmt_bytes

TABLE = trace_store.SHIPPED


def encode_vram(config: PipelineConfig, device: str | Device = "t4", *, precision: str = "fp16",
                sdpa_backend: str = "efficient", offload: str = "async") -> ModelVRAM:
    """The traced VRAM of `config`'s encode job at its batch on `device` (from the cached stream, or a trace)."""
    dev = device_preset(device)
    warn_if_not_native()
    spec = encode_spec(config, dev, precision, sdpa_backend, offload)
    workspace = cublas_workspace_bytes(dev.compute_capability, run_cublas_config(False))
    return _at_batch(json.dumps(spec, sort_keys=True), config.run.batch_size, dev, workspace)


def vram_lines(vram: ModelVRAM) -> tuple[Line, ...]:
    """The budget's VRAM lines: the trace's, and where the one cuBLAS workspace block may land, as a line."""
    margin = Line("workspace placement margin", vram.workspace_margin,
                  "where the cuBLAS workspace block lands moves reserved memory: " + ", ".join(
                      f"{pos} {fmt_bytes(b)}" for pos, b in vram.reserved_by_position.items())
                  + "; the budget counts the worst")
    return (*vram.lines, margin)


def encode_spec(config: PipelineConfig, dev: Device, precision: str, sdpa_backend: str, offload: str) -> dict:
    """Everything but the batch that moves the encode loop's allocations: the child's payload, less the batch."""
    r = config.run
    return {**model_payload(config.model), "precision": precision, "train": False, "output": None, "classes": 12,
            "cc": dev.compute_capability, "out_dtype": r.out_dtype, "outputs": list(r.outputs), "offload": offload,
            "every": r.consolidate_every if offload == "consolidate" else 1, "sdpa": sdpa_backend}


def traced_entries(specs: list[dict]) -> list[dict]:
    """Fresh traces of `specs` (one model and CUBLAS_WORKSPACE_CONFIG): table entries (torch, spec, stream, op
    at the peak), traced in one child process (the model built once).
    """
    out = run_job(job_for("encode"), {**specs[0], "variants": specs})
    entries = [{**trace_store.entry_key(spec, trace_store.torch_release()), "peak_op": peak_op,
                "stream": stream and [[*e[:2], 0, 0] if e[0] == "w" else e for e in stream]}   # sized at replay
               for spec, (stream, peak_op) in zip(specs, out["entries"])]
    for entry in entries:
        if entry["stream"] is None:
            raise AssertionError(f"the TRM's encode trace is not affine in the batch: {entry['spec']}")
    return entries


def entry_text(entry: dict) -> str:
    """A table entry as its file holds it: one event a line, so a changed trace reads as a diff."""
    head = json.dumps({k: entry[k] for k in ("torch", "spec", "format", "env", "peak_op", "nblib") if k in entry},
                      sort_keys=True)
    events = ",\n".join(json.dumps(list(e), separators=(",", ":")) for e in entry["stream"])
    return f'{{"head": {head},\n"stream": [\n{events}\n]}}\n'


@lru_cache(maxsize=64)
def _stream(key: str) -> tuple[list, str, str]:
    """(stream, peak op, label) of a spec: the trace cache's (trace_store.find: the shipped table, then the user's
    folder), else a fresh trace, kept in the user's folder.
    """
    spec = json.loads(key)
    found = trace_store.find(spec)
    if found is not None:
        (entry, path), shipped = found, found[1].parent == TABLE
        where = "nblib/trace_seed" if shipped else f"the trace cache {path.parent}"
        return entry["stream"], entry["head"]["peak_op"], (
            f"traced on the simulated GPU (FakeTensorMode) under torch {entry['head']['torch']}, replayed from "
            f"{where}; the CUDA context is an assumption")
    entry = traced_entries([spec])[0]
    key = trace_store.entry_key(spec, entry["torch"], entry["env"])
    trace_store.save(entry_text({**entry, **trace_store.user_key(key)}), key)
    return entry["stream"], entry["peak_op"], ModelVRAM.label


@lru_cache(maxsize=4096)
def _at_batch(key: str, batch_size: int, dev: Device, workspace: int) -> ModelVRAM:
    """The budget at one batch: the stream replayed, each cuBLAS workspace the size this process's
    CUBLAS_WORKSPACE_CONFIG gives (where it lands in the stream does not depend on its size).
    """
    stream, peak_op, label = _stream(key)
    stream = [(*e[:2], workspace, 0) if e[0] == "w" else e for e in stream]
    point = replayed_point(stream, batch_size, peak_op)
    return replace(_budget(json.loads(key), dev, batch_size, point, None), label=label)

