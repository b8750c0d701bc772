"""The budget of record shards: the shard size that fits a RAM, the batch that fits a VRAM (pure functions).

The sharding guide sizes shards (400-500 MB) and batches for a 24 GB GPU by hand, from the size
of the records alone. Done right, each figure is a sum of itemized lines, every line with its
reason, and what is left over divided by what one more unit costs:

- RAM, per process reading shards: the mapped stored shard(s) it holds (`resident_shards`: 2
  when the next shard is prefetched while this one is served), plus the whole shard decoded when
  the loop loads a shard at once (`decode_whole_shard`, the guide's way; nblib's reader decodes one
  record at a time), plus a record in flight; each DataLoader worker holds its own copy, and
  each process has a fixed cost (the interpreter, numpy, torch).
- VRAM: the CUDA context, the weights, their gradients and the optimizer's state, then per record
  of the batch its tensors at their largest shape (padded batches) and the activations one record
  costs in the model, which only a trace of the model gives (`activation_bytes_per_record`:
  measure it, e.g. with `nblib.measure`, or the simulated T4 of `nblib.simulate`), then a margin
  for the allocator's fragmentation.

Nothing here reads a file or imports torch. (It lives beside the record shards for now; its home
is `nblib.budget`, next to the image cache's shard plan, once that package's layering settles.)
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from nblib.errors import BudgetExceeded, ConfigError
from nblib.units import MB, fmt_bytes

FIXED_RAM = 400 * MB           # a Python process with numpy and torch imported, before data (measured ~350-450 MB)
WORKER_RAM = 250 * MB          # each DataLoader worker process on top (forked: shared pages are not counted twice)
CUDA_CONTEXT = 450 * MB        # CUDA context + cuBLAS/cuDNN workspaces on a T4 (what torch.cuda shows as reserved
                               # before any tensor: 300-500 MB depending on the libraries loaded)
OPTIMIZER_STATES = {"adam": 2, "adamw": 2, "sgd_momentum": 1, "sgd": 0, "none": 0}


@dataclass(frozen=True)
class Line:
    """One itemized term of a budget: what it is and its bytes."""

    what: str
    bytes: int


@dataclass(frozen=True)
class Fit:
    """The largest value that fits (shard bytes, or records per batch), with the lines of its peak."""

    name: str
    value: int
    limit: int
    lines: tuple[Line, ...]

    @property
    def peak(self) -> int:
        return sum(line.bytes for line in self.lines)

    def __str__(self) -> str:
        shown = fmt_bytes(self.value) if self.name == "shard" else f"{self.value:,} records"
        rows = [f"largest {self.name}: {shown} (peak {fmt_bytes(self.peak)} of {fmt_bytes(self.limit)})"]
        rows += [f"  {fmt_bytes(line.bytes):>10}  {line.what}" for line in self.lines]
        return "\n".join(rows)


def record_bytes(shapes: dict[str, tuple[tuple[int, ...], str]]) -> int:
    """Bytes of one record's arrays: {field: (shape, dtype)}."""
    return int(sum(int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize for shape, dtype in shapes.values()))


def largest_shapes(manifest: dict) -> dict[str, tuple[tuple[int, ...], str]]:
    """{array field: (its largest shape in any shard, dtype)} from a record manifest (the batch's worst case)."""
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for name, field in manifest["fields"].items():
        if field["kind"] != "array":
            continue
        shapes = [s["max_shapes"][name] for s in manifest["shards"] if name in s.get("max_shapes", {})]
        shape = tuple(int(max(dims)) for dims in zip(*shapes)) if shapes else ()
        out[name] = (shape, field["dtype"])
    return out


def shard_size_for_ram(ram_bytes: int, *, decoded_per_stored: float = 1.0, decode_whole_shard: bool = True,
                       resident_shards: int = 1, workers: int = 0, largest_record_bytes: int = 0,
                       fixed_bytes: int = FIXED_RAM, worker_bytes: int = WORKER_RAM, margin: float = 0.1) -> Fit:
    """The largest stored shard size whose reading peak fits `ram_bytes` (BudgetExceeded when none does).

    Args:
        ram_bytes: the RAM the job may use (Colab: ~11 GB usable of 12.7).
        decoded_per_stored: raw bytes per stored byte (manifest raw_bytes / bytes; 1.0 for codec raw).
        decode_whole_shard: the loop decodes a whole shard at once (the guide's loop), else one record.
        resident_shards: shards a process holds at once (2: the next one prefetched).
        workers: DataLoader worker processes, each holding its own shards.
        largest_record_bytes: the largest record's raw bytes (one in flight per process).
        fixed_bytes, worker_bytes: a process's and a worker's cost before any data.
        margin: the share of `ram_bytes` kept free.
    """
    _check_positive(ram_bytes=ram_bytes, resident_shards=resident_shards, decoded_per_stored=decoded_per_stored)
    processes = 1 + int(workers)
    usable = int(ram_bytes * (1 - margin))
    fixed = [Line("the main process before data (interpreter, numpy, torch)", int(fixed_bytes)),
             Line(f"{workers} DataLoader worker(s) before data", int(workers * worker_bytes)),
             Line(f"one record in flight per process ({processes})", int(2 * processes * largest_record_bytes))]
    per_byte = processes * resident_shards * (1 + (decoded_per_stored if decode_whole_shard else 0))
    room = usable - sum(line.bytes for line in fixed)
    shard = int(room // per_byte) if room > 0 else 0
    if shard < max(1, largest_record_bytes):
        raise BudgetExceeded(f"no shard size fits {fmt_bytes(ram_bytes)} of RAM: the fixed costs take "
                             f"{fmt_bytes(sum(line.bytes for line in fixed))} of {fmt_bytes(usable)} usable; use "
                             f"fewer workers, decode one record at a time, or a machine with more RAM")
    lines = (*fixed, Line(f"{processes * resident_shards} mapped stored shard(s) of {fmt_bytes(shard)}",
                          processes * resident_shards * shard))
    if decode_whole_shard:
        lines += (Line(f"{processes * resident_shards} decoded shard(s) ({decoded_per_stored:.2f}x stored)",
                       int(processes * resident_shards * shard * decoded_per_stored)),)
    return Fit("shard", shard, int(ram_bytes), lines)


def batch_for_vram(vram_bytes: int, *, record_shapes: dict[str, tuple[tuple[int, ...], str]],
                   activation_bytes_per_record: float, params: int, param_bytes: int = 4, trainable: bool = True,
                   optimizer: str = "adam", on_gpu: tuple[str, ...] | None = None,
                   cuda_context_bytes: int = CUDA_CONTEXT, fragmentation: float = 0.1, margin: float = 0.05) -> Fit:
    """The largest batch of records (at their largest shapes) whose training step fits `vram_bytes`.

    Args:
        vram_bytes: the GPU's memory (T4: 15 GB; the guide's card: 24 GB).
        record_shapes: {field: (shape, dtype)} of the largest record (`largest_shapes(manifest)`).
        activation_bytes_per_record: what one more record adds to the step's peak in the model (a trace).
        params: the model's parameter count.
        param_bytes: bytes per weight (4: fp32 master weights; 2: a bf16 model).
        trainable: gradients and optimizer state are held (False: inference).
        optimizer: a key of OPTIMIZER_STATES (fp32 states per weight).
        on_gpu: the fields moved to the GPU (default every array field).
        cuda_context_bytes: the CUDA context and library workspaces.
        fragmentation: the share of the batch-dependent bytes the caching allocator loses to fragments.
        margin: the share of `vram_bytes` kept free.
    """
    _check_positive(vram_bytes=vram_bytes, params=params, activation_bytes_per_record=activation_bytes_per_record)
    if optimizer not in OPTIMIZER_STATES:
        raise ConfigError(f"optimizer={optimizer!r} is not one of {tuple(OPTIMIZER_STATES)}")
    fields = {k: v for k, v in record_shapes.items() if on_gpu is None or k in on_gpu}
    states = OPTIMIZER_STATES[optimizer] if trainable else 0
    fixed = [Line("CUDA context and library workspaces", int(cuda_context_bytes)),
             Line(f"weights: {params:,} x {param_bytes} B", params * param_bytes),
             Line("gradients", params * param_bytes if trainable else 0),
             Line(f"{optimizer} state: {states} fp32 per weight", params * 4 * states)]
    per_record = (record_bytes(fields) + activation_bytes_per_record) * (1 + fragmentation)
    room = int(vram_bytes * (1 - margin)) - sum(line.bytes for line in fixed)
    batch = int(room // per_record) if room > 0 else 0
    if batch < 1:
        raise BudgetExceeded(f"not one record fits {fmt_bytes(vram_bytes)}: the model's fixed lines take "
                             f"{fmt_bytes(sum(line.bytes for line in fixed))} and a record "
                             f"{fmt_bytes(per_record)}; use a smaller model, bf16 weights, or a GPU with more memory")
    lines = (*fixed,
             Line(f"{batch} x the record's tensors on the GPU ({fmt_bytes(record_bytes(fields))} each, largest shapes)",
                  batch * record_bytes(fields)),
             Line(f"{batch} x activations per record ({fmt_bytes(activation_bytes_per_record)})",
                  int(batch * activation_bytes_per_record)),
             Line(f"allocator fragmentation ({fragmentation:.0%} of the batch's bytes)",
                  int(batch * (per_record / (1 + fragmentation)) * fragmentation)))
    return Fit("batch", batch, int(vram_bytes), lines)


def budget_table(rams=(12.7e9, 25e9, 51e9), vrams=(15e9, 24e9, 40e9), **kwargs) -> list[dict]:
    """The guide's table, done by the functions above: one row per (RAM, VRAM) pair.

    kwargs: `shard_size_for_ram`'s and `batch_for_vram`'s arguments (record_shapes,
    activation_bytes_per_record and params are needed).
    """
    ram_args = {k: kwargs.pop(k) for k in list(kwargs) if k in ("decoded_per_stored", "decode_whole_shard",
                                                                 "resident_shards", "workers", "largest_record_bytes")}
    rows = []
    for ram, vram in zip(rams, vrams):
        shard = shard_size_for_ram(int(ram), **ram_args)
        batch = batch_for_vram(int(vram), **kwargs)
        rows.append({"ram_bytes": int(ram), "vram_bytes": int(vram), "shard_bytes": shard.value,
                     "shard_mb": math.floor(shard.value / MB), "batch": batch.value})
    return rows


def _check_positive(**values) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
            raise ConfigError(f"{name}={value!r} must be a finite number > 0")
