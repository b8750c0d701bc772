"""The budget of record shards: the shard size that fits a RAM (pure functions; test support).

The sharding guide sizes shards (400-500 MB) and batches for a 24 GB GPU by hand, from the size
of the records alone. Done right, each figure is a sum of itemized lines, every line with its
reason, and what is left over divided by what one more unit costs:

- RAM, per process reading shards: the mapped stored shard(s) it holds (`resident_shards`: 2
  when the next shard is prefetched while this one is served), plus the whole shard decoded when
  the loop loads a shard at once (`decode_whole_shard`, the guide's way; nblib's reader decodes one
  record at a time), plus a record in flight; each DataLoader worker holds its own copy, and
  each process has a fixed cost (the interpreter, numpy, torch).
- VRAM is not counted here: the batch that fits a GPU is the trace of the model's own training step,
  `nblib.budget.model_vram(..., train=True)`.

Nothing here reads a file or imports torch. No job or verb asks it yet, so it lives with the tests
that hold it to the encode budget's per-process figures and the one margin (tests/test_one_margin.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from nblib.budget.memory import LOADER_WORKER_RAM, RUNTIME_RAM_CPU
from nblib.budget.resources import FIT_MARGIN
from nblib.budget.resources import room as fit_room
from nblib.errors import BudgetExceeded, ConfigError
from nblib.units import fmt_bytes


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


def shard_size_for_ram(ram_bytes: int, *, decoded_per_stored: float = 1.0, decode_whole_shard: bool = True,
                       resident_shards: int = 1, workers: int = 0, largest_record_bytes: int = 0,
                       fixed_bytes: int = RUNTIME_RAM_CPU, worker_bytes: int = LOADER_WORKER_RAM,
                       margin: float = FIT_MARGIN) -> Fit:
    """The largest stored shard size whose reading peak fits `ram_bytes` (BudgetExceeded when none does).

    Args:
        ram_bytes: the RAM the job may use (a Colab T4: the t4 preset's `ram_bytes`, 11.0 GB usable of 12.7).
        decoded_per_stored: raw bytes per stored byte (manifest raw_bytes / bytes; 1.0 for codec raw).
        decode_whole_shard: the loop decodes a whole shard at once (the guide's loop), else one record.
        resident_shards: shards a process holds at once (2: the next one prefetched).
        workers: DataLoader worker processes, each holding its own shards.
        largest_record_bytes: the largest record's raw bytes (one in flight per process).
        fixed_bytes, worker_bytes: a process's and a worker's cost before any data (the encode budget's
            `nblib.budget.memory` constants: one figure per process, one per worker).
        margin: the share of `ram_bytes` kept free (`resources.FIT_MARGIN`, the one rule).
    """
    _check_positive(ram_bytes=ram_bytes, resident_shards=resident_shards, decoded_per_stored=decoded_per_stored)
    processes = 1 + int(workers)
    usable = int(fit_room(ram_bytes, margin))
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


def _check_positive(**values) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
            raise ConfigError(f"{name}={value!r} must be a finite number > 0")
