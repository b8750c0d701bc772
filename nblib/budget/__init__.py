"""Every prediction: the VRAM, RAM, disk and time a pipeline config needs, and refusing jobs that do not fit.

`predict_budget(config, device)` returns a `Budget`: itemized lines (bytes + a one-line reason)
for VRAM, RAM, local disk and Drive, a time estimate from FLOPs, and a verdict naming the limit
that binds, and for every resource over its limit the knobs with the values that fit. Memory
lines count only the buffers live at the peak. `preflight` checks the same prediction against
this machine's free disk, RAM and VRAM (and Drive's own limits) and raises `BudgetExceeded` with
the numbers and the knob to turn; `plan_budget` picks knobs that fit. Trade-off: a closed-form model
is instant and explains itself, but it is only as right as its accounting;
`benchmarks/budget_accuracy.py` checks it against measured peaks. Pure Python: no torch here.

Parts: devices (the machines), memory (model arithmetic, memory lines), disk (cache, parts,
shards, the disk check), drive (Drive's items-per-folder and daily-upload limits), checkpoint
(tf.data shuffle checkpoints), predict (the Budget), advice (the knobs that fit, per resource),
preflight, knobs (plan_budget), model_vram (any model's VRAM from a trace of its own code on the
simulated GPU, in a subprocess: trace, shim, allocator).
"""
from __future__ import annotations

from nblib.budget._checks import require_positive
from nblib.budget.advice import cache_knobs, closing_knobs
from nblib.budget.devices import DEVICES, Device, device_preset, device_preset_name
from nblib.budget.disk import (
    CODEC_RATIO_ESTIMATE,
    NO_CACHE,
    NPY_HEADER_BYTES,
    ShardPlan,
    cache_bytes,
    cache_shards,
    check_disk,
    choose_codec,
    plan_shards,
    raw_bytes_per_image,
    uploaded_bytes,
)
from nblib.budget.drive import FOLDER_ITEMS_LIMIT, smallest_checkpoint_every
from nblib.budget.encode_trace import encode_vram
from nblib.budget.knobs import plan_budget
from nblib.budget.memory import (
    RUNTIME_RAM_CPU,
    RUNTIME_RAM_CUDA,
    Line,
    flops_per_image,
    forward_peak_delta,
    model_memory_lines,
    output_bytes_per_batch,
    output_bytes_per_image,
    output_shapes,
    param_count,
)
from nblib.budget.model_vram import FIT_MARGIN, model_vram
from nblib.budget.predict import Budget, calibrate, max_batch_size, predict_budget
from nblib.budget.preflight import model_preflight, model_vram_check, preflight
from nblib.budget.resources import KNOBS, RESOURCES
from nblib.budget.shuffle_checkpoint import (
    ShuffleCheckpoint,
    checkpoint_disk_peak,
    checkpoint_ram_peak,
    shuffle_checkpoint,
    shuffle_checkpoint_table,
)
from nblib.config import OUTPUT_CHOICES

__all__ = [
    "FIT_MARGIN", "encode_vram", "model_vram",
    "FOLDER_ITEMS_LIMIT", "cache_knobs", "cache_shards", "closing_knobs", "smallest_checkpoint_every",
    "uploaded_bytes",
    "CODEC_RATIO_ESTIMATE", "DEVICES", "KNOBS",
    "NO_CACHE", "NPY_HEADER_BYTES", "OUTPUT_CHOICES", "RESOURCES", "RUNTIME_RAM_CPU",
    "RUNTIME_RAM_CUDA", "Budget", "Device", "Line", "ShardPlan", "ShuffleCheckpoint",
    "cache_bytes", "calibrate", "check_disk", "checkpoint_disk_peak",
    "checkpoint_ram_peak", "choose_codec", "device_preset", "device_preset_name",
    "flops_per_image",
    "forward_peak_delta", "max_batch_size", "model_memory_lines", "output_bytes_per_batch",
    "output_bytes_per_image", "output_shapes", "param_count", "plan_budget", "plan_shards",
    "model_preflight", "model_vram_check", "predict_budget", "preflight", "require_positive", "shuffle_checkpoint",
    "raw_bytes_per_image", "shuffle_checkpoint_table",
]
