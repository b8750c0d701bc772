"""The VRAM budget of any model, from a trace of its own code on the simulated GPU.

`model_vram(spec, batch_size, "t4", precision="fp16", train=False)` loads the model (nblib.models)
in a fresh process with the fake-CUDA shim (nblib.budget.shim), moves it to a fake cuda:0 and runs
what the job runs: for encoding, the input copy and the forward under inference_mode and autocast;
for training, three steps of forward, loss, GradScaler-scaled backward, AdamW (foreach=False) and
zero_grad(set_to_none=True), as nblib.train's train_step, on a head over a named output or the
model's own logits (nblib.models.head). Every storage is replayed through the caching-allocator
model (nblib.budget.allocator), in PyTorch's order (a GEMM's output before cuBLAS's workspace,
nblib.budget.trace). FakeTensorMode computes nothing, so a ViT-B/16 answers in seconds.
The lines: the CUDA context (hand-written: no trace sees it), then what the trace holds. Where the
one cuBLAS workspace block lands moves reserved memory by up to a segment: the other plausible
positions are replayed from the same allocation stream and stated as a margin, never hidden.
The largest batch that fits is found by bisection with `FIT_MARGIN`, the rule max_batch_size uses.
Trade-off: a trace sees only what runs through the caching allocator; cuDNN's transient
workspaces, NCCL buffers and fragmentation under memory pressure are outside it.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field

from nblib.budget.devices import Device, device_preset
from nblib.budget.memory import Line
from nblib.budget.resources import FIT_MARGIN, largest_fitting  # the one rule for "fits"
from nblib.budget.shim import run_child
from nblib.errors import BudgetExceeded, ConfigError
from nblib.units import GB, fmt_bytes

PRECISIONS = ("fp16", "bf16", "fp32")
TRAIN_STEPS = 3             # AdamW's moments exist from the first step: steps 2 and 3 are the steady state
ENCODE_BATCHES = 2          # the second batch meets the first one's cached segments
OUT_DTYPE = "float16"       # the dtype encode stores outputs in (PipelineConfig.run.out_dtype's default)
CONTEXT_SOURCE = ("driver + kernel images, outside torch's allocator: an assumption (300-500 MB on a T4, "
                  "budget.DEVICES), no trace sees it")


@dataclass(frozen=True)
class ModelVRAM:
    """A traced VRAM budget: lines (bytes + why), the workspace margin, the largest batch that fits."""

    spec: str
    device: str
    precision: str
    train: bool
    batch_size: int
    lines: tuple[Line, ...]
    workspace_margin: int           # reserved at the worst plausible workspace position, minus the total's
    limit: int                      # VRAM of the device
    largest_batch: int | None       # the largest batch whose high end fits (1 - FIT_MARGIN) x limit
    reserved_by_position: dict = field(default_factory=dict)
    peak_op: str = ""
    label: str = "traced on the simulated GPU (FakeTensorMode); the CUDA context is an assumption"

    @property
    def total(self) -> int:
        return sum(line.bytes for line in self.lines)

    @property
    def high(self) -> int:
        return self.total + self.workspace_margin

    @property
    def reserved(self) -> int:
        """Simulated max_memory_reserved at PyTorch's order (the lines without the CUDA context)."""
        return self.total - self.line("CUDA context")

    @property
    def fits(self) -> bool:
        return self.high <= self.limit * (1 - FIT_MARGIN)

    def line(self, name: str) -> int:
        return sum(line.bytes for line in self.lines if line.name == name)

    def table(self) -> str:
        job = "training step" if self.train else "encoding"
        rows = [f"VRAM of {self.spec} on a {self.device}, {job}, {self.precision}, batch {self.batch_size} "
                f"({self.label})"]
        rows += [f"  {ln.name:<36}{fmt_bytes(ln.bytes):>11}  {ln.why}" for ln in self.lines]
        rows.append(f"  {'total':<36}{fmt_bytes(self.total):>11}  of {self.limit / GB:.2f} GB")
        rows.append(f"  {'+ cuBLAS workspace placement margin':<36}{fmt_bytes(self.workspace_margin):>11}  "
                    f"range {fmt_bytes(self.total)} - {fmt_bytes(self.high)}: " + ", ".join(
                        f"{pos}: {fmt_bytes(b)}" for pos, b in self.reserved_by_position.items()))
        verdict = "fits" if self.fits else "does NOT fit"
        rows.append(f"  {verdict} in {1 - FIT_MARGIN:.0%} of {self.limit / GB:.2f} GB; largest batch that fits: "
                    f"{self.largest_batch if self.largest_batch is not None else 'not searched'}")
        return "\n".join(rows)

    def as_json(self) -> dict:
        return {"model": self.spec, "device": self.device, "precision": self.precision, "train": self.train,
                "batch_size": self.batch_size, "vram_lines": [{"name": ln.name, "bytes": ln.bytes, "why": ln.why}
                                                              for ln in self.lines],
                "total_bytes": self.total, "workspace_margin_bytes": self.workspace_margin,
                "high_bytes": self.high, "limit_bytes": self.limit, "fit_margin": FIT_MARGIN, "fits": self.fits,
                "largest_batch": self.largest_batch, "reserved_by_workspace_position": self.reserved_by_position,
                "label": self.label}

    def refuse_if_over(self) -> None:
        """BudgetExceeded with the numbers and the knob when this budget does not fit."""
        if not self.fits:
            fix = (f"use --batch-size {self.largest_batch} or less" if self.largest_batch else
                   "even batch 1 does not fit: a smaller model or a GPU with more memory" if self.largest_batch == 0
                   else "lower --batch-size (budget it with python -m nblib budget --model ...)")
            raise BudgetExceeded(
                f"{self.spec} at batch {self.batch_size} ({self.precision}, "
                f"{'training' if self.train else 'encoding'}) needs {self.high / GB:.2f} GB of VRAM (high end, "
                f"CUDA context included) and a {self.device} allows {(1 - FIT_MARGIN) * self.limit / GB:.2f} GB "
                f"({1 - FIT_MARGIN:.0%} of {self.limit / GB:.2f} GB); {fix}"
                + ("" if self.precision != "fp32" else ", or --precision fp16"))


def model_vram(model, batch_size: int, device: str | Device = "t4", *, precision: str = "fp16",
               train: bool = False, output: str | None = None, n_classes: int = 12,
               find_largest: bool = True, max_batch: int = 4096, timeout_s: float = 600.0,
               out_dtype: str = OUT_DTYPE) -> ModelVRAM:
    """The traced VRAM budget of `model` (a spec string or a LoadedModel) at `batch_size` on `device`.

    out_dtype: the dtype encoding casts each output to on the device before its copy out (the run's).
    """
    dev = device_preset(device)
    if not dev.is_gpu:
        raise ConfigError(f"device {dev.name!r} has no VRAM; name a GPU preset such as t4")
    if precision not in PRECISIONS:
        raise ConfigError(f"precision={precision!r} is unknown; choose one of {PRECISIONS}")
    if batch_size < 1:
        raise ConfigError(f"batch_size={batch_size} must be >= 1")
    payload = {**model_payload(model), "precision": precision, "train": train, "output": output,
               "classes": n_classes, "cc": dev.compute_capability, "batch": batch_size, "out_dtype": out_dtype,
               "cap": reserved_cap(dev),
               "search": find_largest, "max_batch": max(max_batch, batch_size)}
    out = run_child("nblib.budget.model_vram", payload, timeout_s=timeout_s)
    point = out["point"]
    lines = (Line("CUDA context", dev.cuda_context_bytes, CONTEXT_SOURCE), *_lines(point, train, precision))
    by_pos = point["reserved"]
    base = next(iter(by_pos.values()))
    return ModelVRAM(spec=payload["spec"], device=dev.name, precision=precision, train=train,
                     batch_size=batch_size, lines=lines, workspace_margin=max(by_pos.values()) - base,
                     limit=dev.vram_bytes, largest_batch=out.get("largest"), reserved_by_position=by_pos,
                     peak_op=point["peak_op"])


def reserved_cap(device: str | Device) -> int:
    """The reserved VRAM a job may reach on a GPU preset: (1 - FIT_MARGIN) of its VRAM less the CUDA context."""
    dev = device_preset(device)
    return int(dev.vram_bytes * (1 - FIT_MARGIN)) - dev.cuda_context_bytes


def model_payload(model) -> dict:
    """What a child process needs to rebuild `model` (a spec string or a LoadedModel)."""
    if isinstance(model, str):
        return {"spec": model, "weights": None, "trm_model": None}
    trm = model.config["model"] if model.kind == "trm" else None
    return {"spec": model.spec, "weights": model.weights, "trm_model": trm}


def _lines(p: dict, train: bool, precision: str) -> list[Line]:
    ws = p["workspace"]
    resident = p["resident"] - ws - p["weights"]
    out = [Line("parameters and buffers", p["weights"], "traced: the module's storages after .to(cuda)")]
    if train:
        out.append(Line("gradients, AdamW moments, GradScaler", resident,
                        "traced: held between steps (fp32 grads set to None, exp_avg, exp_avg_sq, step, scale)"))
    out += [
        Line("input batch and activations at the peak", p["max_allocated"] - p["resident"],
             f"traced: live at the peak ({p['peak_op']}) beyond what stays between "
             f"{'steps' if train else 'batches'}; {precision} autocast"),
        Line("cuBLAS workspace", ws, "traced: allocated on the first GEMM after its output, kept"
             if ws else "traced: no GEMM ran"),
        Line("allocator cache", p["reserved_pytorch"] - p["max_allocated"],
             "traced: segments the caching allocator holds beyond the live bytes (allocator model)"),
    ]
    return out


# ---------------------------------------------------------------- the child process
TRACED_BATCHES = (2, 3)     # two small traces give every batch's allocation stream (events_at_batch)


def _child(payload: dict) -> dict:
    from nblib.budget.shim import child_model

    loaded = child_model(payload)
    from nblib.budget.trace import WORKSPACE_POSITIONS, events_at_batch, replay_stats
    b0, b1 = TRACED_BATCHES
    low, high = trace_job(loaded, b0, payload), trace_job(loaded, b1, payload)
    traced = {b0: low, b1: high}

    def point(b: int) -> dict:
        if b not in traced:
            events = events_at_batch(low["events"], high["events"], b0, b1, b)
            if events is None:                      # not batch-affine: trace this batch itself
                traced[b] = trace_job(loaded, b, payload)
            else:
                stats = {pos: replay_stats(events, pos) for pos in WORKSPACE_POSITIONS}
                first = stats[WORKSPACE_POSITIONS[0]]
                traced[b] = {**high, "events": events, "max_allocated": first["max_allocated"],
                             "reserved_pytorch": first["max_reserved"], "resident": first["marks"]["resident"],
                             "weights": first["marks"]["weights"],
                             "reserved": {pos: st["max_reserved"] for pos, st in stats.items()}}
        return {k: v for k, v in traced[b].items() if k != "events"}

    out = {"point": point(payload["batch"]), "affine": events_at_batch(
        low["events"], high["events"], b0, b1, b1 + 1) is not None}
    if payload["search"]:
        def fits(b: int) -> bool:
            return max(point(b)["reserved"].values()) <= payload["cap"]
        out["largest"] = largest_fitting(fits, payload["max_batch"])
    return out


def trace_job(loaded, b: int, payload: dict) -> dict:
    """One job (encode batches or training steps) at batch `b` on a fresh fake device: the traced figures."""
    import copy
    from unittest import mock

    import torch

    from nblib.budget.trace import CUBLAS_WORKSPACE, attention_as_on_gpu, fake_cuda, step_trace_class
    from nblib.models.head import _image_size, with_head
    from nblib.models.outputs import named_outputs

    size = _image_size(loaded)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(payload["precision"])
    out_dtype = getattr(torch, payload.get("out_dtype", OUT_DTYPE))
    # a copy per trace: .to() on a fake device replaces the parameters with fake tensors
    if payload["train"]:
        module = copy.deepcopy(with_head(loaded, payload["classes"], payload["output"], image_size=size)).train()
    else:
        module = copy.deepcopy(loaded.module).eval()
    with fake_cuda(), mock.patch("torch.cuda.is_bf16_supported", return_value=True), \
            torch.autograd.set_multithreading_enabled(False):
        trace = step_trace_class()(payload["cc"])
        with trace, attention_as_on_gpu(trace):
            host = torch.empty((b, size, size, 3), dtype=torch.uint8)
            module.to("cuda:0")
            weights = trace.allocator.allocated
            trace.mark("weights")
            if payload["train"]:
                resident = _train_steps(module, host, b, dtype, payload, trace)
            else:
                for _ in range(ENCODE_BATCHES):
                    # as nblib.encode.run's loop: a batch's images stay on the device through its forward,
                    # until the next batch's copy has landed
                    images = host.to("cuda:0")
                    with torch.inference_mode(), torch.autocast("cuda", dtype=dtype or torch.float32,
                                                                enabled=dtype is not None):
                        outputs = named_outputs(module(loaded.preprocessing.apply(images)))
                    # its offload (nblib.encode.offload.HostPart.add, async): each output is cast to the
                    # run's out_dtype on the device, beside the outputs, before its copy out
                    cast = {n: t.to(out_dtype) for n, t in outputs.items()}
                    del outputs, cast
                del images
                resident = trace.allocator.allocated
                trace.mark("resident")
    ws = CUBLAS_WORKSPACE[trace.cc >= 90] if any(e[0] == "w" for e in trace.events) else 0
    by_pos = trace.reserved_by_position()
    return {"weights": weights, "resident": resident, "workspace": ws, "events": trace.events,
            "max_allocated": trace.allocator.max_allocated, "reserved_pytorch": trace.allocator.max_reserved,
            "reserved": by_pos, "peak_op": trace.peak.op if trace.peak else ""}


def _train_steps(net, host, b: int, dtype, payload: dict, trace) -> int:
    """TRAIN_STEPS steps as nblib.train's train_step: autocast forward, scaled backward, AdamW, zero_grad."""
    import torch
    import torch.nn.functional as F

    trained = [p for p in net.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=1e-4, foreach=False)
    scaler = torch.amp.GradScaler("cuda", enabled=payload["precision"] == "fp16")
    labels = torch.zeros(b, dtype=torch.int64)
    for _ in range(TRAIN_STEPS):
        images, target = host.to("cuda:0"), labels.to("cuda:0")
        with torch.autocast("cuda", dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = F.cross_entropy(net(images), target)
            scaler.scale(loss).backward()
        float(loss.detach())
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        del images, target, loss
    trace.mark("resident")                 # the optimizer's state is alive here, not after return
    return trace.allocator.allocated


if __name__ == "__main__":
    print(json.dumps(_child(json.loads(sys.argv[1]))), flush=True)
