"""The VRAM budget of any model, from a trace of its own code on the simulated GPU.

`model_vram(spec, batch_size, "t4", precision="fp16", train=False)` asks the trace layer
(nblib.budget.traced_jobs) for the job of its kind, the one the job's own package handed over: it loads
the model (nblib.models) in a child process with the fake-CUDA shim (nblib.budget.shim), moves it to a fake
cuda:0 and runs what the job runs: for encoding, the input copy, the forward under inference_mode and
autocast and the run's HostPart (nblib.encode.traced); for training, the module the loop runs and three
calls of the loop's own train_step with its training_objects (nblib.train.traced). The budget imports
neither: it is given the job. Every storage is replayed
through the caching-allocator model (nblib.budget.allocator), in PyTorch's order (a GEMM's output
before cuBLAS's workspace, nblib.budget.trace). FakeTensorMode computes nothing, so a ViT-B/16 answers in seconds.
The lines: the CUDA context (hand-written: no trace sees it), then what the trace holds. Where the
one cuBLAS workspace block lands moves reserved memory by up to a segment: the other plausible
positions are replayed from the same allocation stream and stated as a margin, never hidden.
The largest batch that fits is found by bisection with `FIT_MARGIN`, the rule max_batch_size uses.
A batch-affine job's stream is kept per process (`job_key`: all but the batch): its next batch, a slider's
move, or the search, is a replay here (`replayed_point`, what the child reports), no new trace. The child's result
is kept in the user's trace cache too (nblib.budget.trace_store, `stored_key`: the job, the model's source, the
traced batches), with the largest batch searched at each cap, so the same budget in a new process starts no child
and replays only its own batch; a factory whose source file cannot be read is traced every time.
Trade-offs: a factory's module is keyed by its own file, not by the modules it imports; a trace sees only what
runs through the caching allocator; cuDNN's transient workspaces, NCCL buffers and fragmentation under memory
pressure are outside it.
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from importlib.machinery import PathFinder

from nblib.atomic import sha256_file
from nblib.budget import trace_store
from nblib.budget.allocator import stream_point, warn_if_not_native
from nblib.budget.devices import Device, device_preset
from nblib.budget.memory import Line
from nblib.budget.resources import FIT_MARGIN  # the one rule for "fits"
from nblib.budget.shim import run_cublas_config, traced_environment
from nblib.budget.traced_jobs import TRACED_BATCHES, job_for, largest_batch, run_job, token_length
from nblib.env import installed_version
from nblib.errors import BudgetExceeded, ConfigError, NblibError, require_choice
from nblib.units import GB, fmt_bytes

PRECISIONS = ("fp16", "bf16", "fp32")
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
    nondeterministic: tuple = ()    # training: ops torch documents nondeterministic on CUDA (nblib.train.determinism)

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

    def headline(self) -> str:
        """'6.86 GB (to 7.00 GB) of 15.00 GB: fits in 90%': every surface that prints one batch's VRAM reads so."""
        spread = f" (to {fmt_bytes(self.high)})" if self.workspace_margin else ""
        return (f"{fmt_bytes(self.total)}{spread} of {self.limit / GB:.2f} GB: "
                f"{'fits' if self.fits else 'does NOT fit'} in {1 - FIT_MARGIN:.0%}")

    def table(self) -> str:
        job = "training step" if self.train else "encoding"
        rows = [f"VRAM of {self.spec} on a {self.device}, {job}, {self.precision}, batch {self.batch_size:,} "
                f"({self.label})"]
        rows += [f"  {ln.name:<36}{fmt_bytes(ln.bytes):>11}  {ln.why}" for ln in self.lines]
        rows.append(f"  {'total':<36}{fmt_bytes(self.total):>11}  of {self.limit / GB:.2f} GB")
        rows.append(f"  {'+ cuBLAS workspace placement margin':<36}{fmt_bytes(self.workspace_margin):>11}  "
                    f"range {fmt_bytes(self.total)} - {fmt_bytes(self.high)}: " + ", ".join(
                        f"{pos}: {fmt_bytes(b)}" for pos, b in self.reserved_by_position.items()))
        verdict = "fits" if self.fits else "does NOT fit"
        rows.append(f"  {verdict} in {1 - FIT_MARGIN:.0%} of {self.limit / GB:.2f} GB; largest batch that fits: "
                    f"{'not searched' if self.largest_batch is None else f'{self.largest_batch:,}'}")
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


def model_vram(model, batch_size: int, device: str | Device = "t4", **options) -> ModelVRAM:
    """The traced VRAM budget of `model` (a spec string, a LoadedModel, or a TRM's ModelConfig) at `batch_size`
    on `device`; `options`: `model_vram_table`'s.
    """
    return model_vram_table(model, (batch_size,), device, **options)[0]


def model_vram_table(model, batches, device: str | Device = "t4", *, precision: str = "fp16", train: bool = False,
                     output: str | None = None, n_classes: int = 12, find_largest: bool = True,
                     max_batch: int = 4096, timeout_s: float = 600.0, out_dtype: str = OUT_DTYPE,
                     inputs: str = "images", record: dict | None = None) -> list[ModelVRAM]:
    """`model_vram` at each of `batches`, from one trace (a slider's range: every row is the same answer).

    out_dtype: the dtype encoding casts each output to on the device before its copy out (the run's).
    inputs: what the model is called with: "images" (uint8 [B, H, W, 3] through its preprocessing) or
    "tokens:LENGTH" (int64 input_ids and attention_mask of [B, LENGTH], a BERT-style text encoder). Training on
    tokens is a `train --records` step on records of LENGTH token ids (its mask from the lengths) with class
    labels of the output's rows; record: that step on other records (nblib.train.traced.record_batch), as the
    CUDA preflight of `train --records` gives it.
    """
    batches = [int(b) for b in batches]
    dev = device_preset(device)
    if not dev.is_gpu:
        raise ConfigError(f"device {dev.name!r} has no VRAM; name a GPU preset such as t4")
    require_choice("precision", precision, PRECISIONS)
    if not batches or min(batches) < 1:
        raise ConfigError(f"batch sizes {batches} must be >= 1")
    length = token_length(inputs)
    if train and record is None and length is not None:
        record = {"input": [[length], "int64"], "target": None, "loss": "ce"}
    if record is not None and not train:
        raise ConfigError("a record input is budgeted for training (train=True); encoding takes images or tokens")
    warn_if_not_native()
    job = {**model_payload(model), "precision": precision, "train": train, "output": output, "classes": n_classes,
           "cc": dev.compute_capability, "out_dtype": out_dtype, **({} if inputs == "images" else {"inputs": inputs}),
           **({} if record is None else {"record": record})}
    payload = {**job, "batches": batches, "cap": reserved_cap(dev), "search": find_largest,
               "max_batch": max(max_batch, *batches)}
    key = job_key(job)
    if key not in _STREAMS:
        out, kept = kept_trace(job, payload, timeout_s)
        if out.get("stream") is None:           # not batch-affine: the child traced each batch itself
            return [_budget(payload, dev, b, point, out.get("largest"), tuple(out["nondeterministic"]))
                    for b, point in zip(batches, out["points"])]
        if len(_STREAMS) >= KEPT_JOBS:
            _STREAMS.pop(next(iter(_STREAMS)))  # the oldest job
        _STREAMS[key] = _Stream(out["stream"], out["peak_op"], tuple(out["nondeterministic"]), kept=kept,
                                searched=dict(out.get("searched", {})))
    job_stream = _STREAMS[key]
    job_stream.trace = lambda b: traced_point(payload, b, timeout_s)
    largest = job_stream.largest(payload["cap"], payload["max_batch"]) if find_largest else None
    return [_budget(payload, dev, b, job_stream.point(b), largest, job_stream.nondeterministic) for b in batches]


def trace_child(payload: dict, timeout_s: float = 600.0) -> dict:
    """The trace layer's child for `payload`: the job of its kind (training or encoding), as handed over."""
    return run_job(job_for("train" if payload["train"] else "encode"), payload, timeout_s)


def kept_trace(job: dict, payload: dict, timeout_s: float = 600.0) -> tuple[dict, dict | None]:
    """(the child's result for `payload`, the key it is kept under): the user's trace cache's
    (trace_store.find_result), else traced and kept there. A batch-affine job's stream is kept under its job
    (`stored_key`), any batch's; a job that is not affine under its batches, largest-batch search and cap too.
    """
    job_kept = stored_key(job)
    if job_kept is None:                        # a source that cannot be read: never kept
        return trace_child(payload, timeout_s), None
    asked = {**job_kept, "asked": {k: payload[k] for k in ("batches", "cap", "search", "max_batch")}}
    found = trace_store.find_result(job_kept)
    if found is not None and found.get("stream") is not None:
        return found, job_kept
    found = trace_store.find_result(asked)
    if found is not None:
        return found, asked
    out = trace_child(payload, timeout_s)
    kept = job_kept if out.get("stream") is not None else asked
    trace_store.save_result(kept, out)
    return out, kept


def stored_key(job: dict) -> dict | None:
    """The key a job's trace is kept under in the user's trace cache (trace_store.entry_key: torch's major.minor,
    the format, the shaping variables): `job_key`, the model's source (`model_source`) and the traced batches;
    None where the model's source cannot be read (the job is then traced every time).
    """
    source = model_source(str(job["spec"]))
    if source is None:
        return None
    return trace_store.entry_key({"job": json.loads(job_key(job)), "model": source, "traced": TRACED_BATCHES},
                                 trace_store.torch_release())


def model_source(spec: str) -> dict | None:
    """What builds a spec's model beyond the spec itself: hf: transformers' version and the config file's sha256;
    timm: timm's version; a factory: the sha256 of its module's source file (found as a fresh process on
    PYTHONPATH finds it, without importing it); the TRM: nblib's own code (trace_store.user_key). None where a
    file it names cannot be read.
    """
    head, _, rest = spec.partition(":")
    if head == "trm":
        return {}
    if head in ("hf", "timm"):
        config = rest.partition(":")[2] if head == "hf" else ""
        digest = _file_sha256(config) if config else ""
        package = head.replace("hf", "transformers")
        return None if digest is None else {head: installed_version(package), "config": digest}
    digest = _file_sha256(_module_file(head))
    return None if digest is None else {"factory": digest}


def _file_sha256(path: str | None) -> str | None:
    try:
        return sha256_file(path or "")
    except OSError:
        return None


def _module_file(name: str) -> str | None:
    """The source file of module `name` as a fresh process finds it (its folder, PYTHONPATH, then this process's
    path), found without importing it or its packages; None where it has none (a namespace, a compiled module).
    """
    path = [os.getcwd(), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep)), *sys.path]
    spec, parts = None, name.split(".")
    for i in range(len(parts)):
        spec = PathFinder.find_spec(".".join(parts[:i + 1]), path)
        if spec is None:
            return None
        path = spec.submodule_search_locations or []
    origin = spec.origin if spec is not None else None
    return origin if origin and origin.endswith(".py") else None


def traced_point(payload: dict, b: int, timeout_s: float = 600.0) -> dict:
    """The child's own trace of batch `b` (no replay): where a kept stream's line leaves the model's batches."""
    one = {**payload, "batches": [b], "search": False, "max_batch": b, "replay": False}
    return trace_child(one, timeout_s)["points"][0]


@dataclass
class _Stream:
    """A traced job's affine allocation stream (nblib.budget.allocator.affine_stream), replayed at any batch; a
    batch where its line gives a negative size (outside the traced model's batches) is traced (`trace`).
    """

    stream: list
    peak_op: str
    nondeterministic: tuple
    points: dict = field(default_factory=dict)
    trace: object = None
    kept: dict | None = None                    # its key in the user's trace cache (kept_trace); None: not kept
    searched: dict = field(default_factory=dict)    # "cap:max_batch" -> the largest batch that fits

    def point(self, b: int) -> dict:
        if b not in self.points:
            self.points[b] = replayed_point(self.stream, b, self.peak_op) or self.trace(b)
        return self.points[b]

    def largest(self, cap: int, max_batch: int) -> int:
        """`largest_batch` within `cap`, searched once a stream and cap, and kept with the stream where it is kept:
        the same budget again replays only its own batch.
        """
        at = f"{cap}:{max_batch}"
        if at not in self.searched:
            self.searched[at] = largest_batch(self.point, cap, max_batch)
            if self.kept is not None:
                trace_store.save_result(self.kept, {"stream": self.stream, "peak_op": self.peak_op, "nondeterministic":
                                                    list(self.nondeterministic), "searched": self.searched})
        return self.searched[at]


# this process's traced jobs (job_key -> _Stream): a job's second batch, a slider's move, the largest batch's
# search, is a replay of its stream here, no new child. A job that is not batch-affine is never kept.
_STREAMS: dict[str, _Stream] = {}
KEPT_JOBS = 32                                  # a training stream of a large model is some MB


def job_key(job: dict) -> str:
    """Everything that shapes a job's trace but the batch: the payload less the batch, the run's
    CUBLAS_WORKSPACE_CONFIG, this process's `traced_environment` (NBLIB_/PYTORCH_ variables and PYTHONPATH), and
    the files a spec names (their size and mtime: an edited config is traced again).
    """
    env = traced_environment()
    files = {part: (os.stat(part).st_size, os.stat(part).st_mtime_ns)
             for part in [*str(job["spec"]).split(":"), job["weights"] or ""] if part and os.path.isfile(part)}
    return json.dumps({**_trm_shape(job), "cublas_config": run_cublas_config(job["train"]), "env": env,
                       "files": files}, sort_keys=True, default=str)


def _trm_shape(job: dict) -> dict:
    """A TRM spec ("trm", "trm:t4") as the ModelConfig it builds: the module reads only that (TRMVisionEncoder), so
    `budget --model trm:t4` and notebook 06's t4 ModelConfig are one job.
    """
    from nblib.config import PipelineConfig, preset

    spec = str(job["spec"])
    if job["trm_model"] is not None or job["weights"] is not None or spec.partition(":")[0] != "trm":
        return job
    try:
        model = (preset(spec.partition(":")[2]) if ":" in spec else PipelineConfig()).model
    except NblibError:                          # not a preset: the child says so
        return job
    return {**job, "spec": "trm", "trm_model": dict(model.__dict__)}


def replayed_point(stream: list, b: int, peak_op: str) -> dict:
    """What a trace of batch `b` reports, replayed from the job's affine stream: the one replay, of `model_vram`
    and of the TRM's encode table (nblib.budget.encode_trace). None where the line gives a negative size.
    """
    point = stream_point(stream, b)
    return point and {**point, "peak_op": peak_op}


def _budget(payload: dict, dev: Device, batch_size: int, point: dict, largest: int | None,
            nondeterministic: tuple = ()) -> ModelVRAM:
    train, precision = payload["train"], payload["precision"]
    lines = (Line("CUDA context", dev.cuda_context_bytes, CONTEXT_SOURCE), *_lines(point, train, precision))
    by_pos = point["reserved"]
    base = next(iter(by_pos.values()))
    return ModelVRAM(spec=payload["spec"], device=dev.name, precision=precision, train=train,
                     batch_size=batch_size, lines=lines, workspace_margin=max(by_pos.values()) - base,
                     limit=dev.vram_bytes, largest_batch=largest, reserved_by_position=by_pos,
                     peak_op=point["peak_op"], nondeterministic=nondeterministic)


def reserved_cap(device: str | Device) -> int:
    """The reserved VRAM a job may reach on a GPU preset: (1 - FIT_MARGIN) of its VRAM less the CUDA context."""
    dev = device_preset(device)
    return int(dev.vram_bytes * (1 - FIT_MARGIN)) - dev.cuda_context_bytes


def model_payload(model) -> dict:
    """What a child process needs to rebuild `model` (a spec string, a LoadedModel, or a TRM's ModelConfig)."""
    from nblib.config import ModelConfig

    if isinstance(model, str):
        return {"spec": model, "weights": None, "trm_model": None}
    if isinstance(model, ModelConfig):
        return {"spec": "trm", "weights": None, "trm_model": dict(model.__dict__)}
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
        Line("cuBLAS workspace", ws, "traced: one per cuBLAS handle (forward thread; training: autograd's "
             "device thread too) on its first GEMM, after its output, kept; sized by CUBLAS_WORKSPACE_CONFIG"
             if ws else "traced: no cuBLAS GEMM ran (convolutions run in cuDNN, attention in its own kernels)"),
        Line("allocator cache", p["reserved_pytorch"] - p["max_allocated"],
             "traced: segments the caching allocator holds beyond the live bytes (allocator model)"),
    ]
    return out
