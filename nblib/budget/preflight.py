"""Preflight: check a job's predicted peak disk, RAM and VRAM against this machine before it starts.

`preflight(config, workspace, job=...)` compares `predict_budget` with the free disk of the
folders the job writes (local staging, the Drive copy, the cache folder), available RAM and free
VRAM, and raises `BudgetExceeded` with the numbers and the knobs to turn, each with the value that
fits this machine (`nblib.budget.advice`), when something does not fit. Every check is the one rule,
`nblib.budget.resources.fits` (a need fits within 90% of its limit), and every refusal says so. When the durable root is
Google Drive it also refuses a plan that crosses one of Drive's own limits (items per folder,
uploads per day: `nblib.budget.drive`). Nothing is written before the check. Any other model's VRAM
is `model_vram_check` (a pure check against a GPU preset) and, for a CUDA job, `model_preflight` (this
GPU's preset, then its free memory): both are the traced budget of `nblib.budget.model_vram`, no
second formula.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

from nblib.budget._checks import validated
from nblib.budget.advice import advise_resource, cache_knobs, closing_knobs, knob_words
from nblib.budget.devices import Device, device_preset, device_preset_name
from nblib.budget.disk import cache_bytes, check_disk
from nblib.budget.drive import cache_folder_check, run_folder_check, upload_check
from nblib.budget.memory import RUNTIME_RAM_CPU, RUNTIME_RAM_CUDA
from nblib.budget.model_vram import ModelVRAM, model_vram
from nblib.budget.predict import Budget, predict_budget
from nblib.budget.resources import fits, shortfall_words
from nblib.budget.shim import SimulationUnavailable
from nblib.config import PipelineConfig
from nblib.errors import BudgetExceeded, ConfigError, NotModelled
from nblib.units import GB

log = logging.getLogger(__name__)


def preflight(config: PipelineConfig, workspace, *, job: str = "encode", device: str | None = None,
              disk_bytes: int | None = None, disk_folder=None,
              drive_limits: bool | None = None, cuda_device=None, codec_sizes=None) -> Budget:
    """Check the predicted peak RAM, VRAM and disk against this machine; raise BudgetExceeded.

    job="encode" checks local staging (workspace.staging) and the durable copy (workspace.drive);
    job="cache" checks `disk_bytes` (default: the raw cache) on `disk_folder` (default
    workspace.cache). drive_limits: check Drive's items per folder and uploads per day (default:
    when workspace.drive is on Google Drive's mount). cuda_device: the job's GPU (default the current
    one): its free VRAM and its preset are checked. codec_sizes: bytes per image per codec measured on
    the user's texts (`nblib.codec_sizes`): the cache and the codecs a refusal offers are sized by them,
    not by the reference's ratios. Returns the Budget when everything fits, its limits this machine's
    (`this_machine`: available RAM, free VRAM, the staging and Drive folders' free disk).
    """
    if job not in ("encode", "cache"):
        raise ConfigError(f"job={job!r} is unknown; use 'encode' or 'cache'")
    cfg = validated(config)
    cuda = _cuda_available()
    dev = device_preset(device or (preset_of_this_gpu(_gpu_name(cuda_device)) if cuda else "cpu"))
    machine = this_machine(dev, workspace.staging, cuda_device if dev.is_gpu and cuda else False)
    budget = predict_budget(cfg, machine, codec_sizes=codec_sizes,
                            drive_quota_gb=max(1, _disk_free(workspace.drive)) / GB)
    if _on_google_drive(workspace.drive) if drive_limits is None else drive_limits:
        _check_drive_limits(cfg, job)
    if job == "cache":
        r, measured = cfg.run, dict(codec_sizes.bytes_per_image if codec_sizes else {})
        sizes = {c: cache_bytes(r.n_samples, cfg.model.image_size, c, b, shard_mb=r.shard_mb)
                 for c, b in measured.items()} or None
        need = disk_bytes if disk_bytes is not None else (sizes or {}).get(r.codec) or cache_bytes(
            r.n_samples, cfg.model.image_size, r.codec, shard_mb=r.shard_mb)
        check_disk(disk_folder or workspace.cache, int(need), what=f"the image cache ({r.codec})",
                   knob=lambda free: cache_knobs(cfg, int(need), free, codec_sizes=codec_sizes))
        return budget
    _check_ram(budget)
    if dev.is_gpu and cuda:
        _check_vram(budget)
    local, drive = budget.totals["local disk"], budget.totals["drive"]
    on_drive = _on_google_drive(workspace.drive)      # only then is drive_quota_gb the knob of that disk
    buy = "drive_quota_gb" if on_drive else "free disk"
    if disk_bytes is not None:
        check_disk(disk_folder or workspace.runs, int(disk_bytes), what="the encode run",
                   knob=knob_words(cfg, "drive", on_drive=on_drive, codec_sizes=codec_sizes))
    elif _same_filesystem(workspace.staging, workspace.drive):
        check_disk(workspace.drive, local + drive, what="the encode run (its folder, mirror and cache on one disk)",
                   knob=lambda free: closing_knobs(budget, ("local disk", "drive"), free))
    else:
        check_disk(workspace.staging, local, what="the encode run's folder (every part and the consolidated outputs)",
                   knob=lambda free: closing_knobs(budget, ("local disk",), free))
        check_disk(workspace.drive, drive, what="the image cache and the mirrored parts of the encode run",
                   knob=lambda free: closing_knobs(budget, ("drive",), free, buy=buy))
    return budget


def model_vram_check(model, batch_size: int, device: str | Device = "t4", **job) -> ModelVRAM:
    """Any model's VRAM on the GPU preset `device`: the traced budget (`model_vram`, the one answer) with the
    largest batch that fits; BudgetExceeded naming the GB needed, the GB allowed and that batch when over.

    `model`: a spec or a `nblib.models.LoadedModel`; `job`: model_vram_table's precision, train (a training step
    with a head of n_classes on output, as `nblib.models.with_head`, else the encode loop storing its outputs in
    out_dtype), record and inputs. Pure of this machine: no CUDA is touched.
    """
    vram = model_vram(model, batch_size, device, find_largest=True, **job)
    vram.refuse_if_over()
    return vram


def model_preflight(model, batch_size: int, cuda_device, **job) -> ModelVRAM | None:
    """A CUDA job's VRAM check for any model, before its first batch: `model_vram_check` (of `job`) on the preset
    of this GPU (by its name, else the T4: `preset_of_this_gpu`), then the high end against its free VRAM.

    None, with a warning logged, where no trace can be made: a module passed as an object (the trace
    rebuilds the model from its spec in its own process) or a model whose trace fails (the reason is
    logged); the job then runs unchecked, as it would with preflight=False.
    """
    spec = getattr(model, "spec", model)
    if getattr(model, "kind", None) == "module":
        log.warning("preflight: the VRAM of %s is not checked: a module passed as an object cannot be rebuilt in "
                    "the trace's process; pass a spec (package.module:factory) to have it checked", spec)
        return None
    dev = device_preset(preset_of_this_gpu(_gpu_name(cuda_device)))
    try:
        vram = model_vram_check(model, batch_size, dev, **job)
    except (SimulationUnavailable, NotModelled) as exc:    # a trace that cannot be made, or an RNN it refuses
        log.warning("preflight: the VRAM of %s is not checked: %s", spec, exc)
        return None
    free = _free_vram(cuda_device)
    need, limit = vram_needed(vram.high, dev.cuda_context_bytes), free + dev.cuda_context_bytes
    if not fits(vram.high, limit):
        raise BudgetExceeded(
            f"{vram.spec} at batch {batch_size} ({vram.precision}, {'training' if vram.train else 'encoding'}) needs "
            f"{need / GB:.2f} GB of VRAM beside the CUDA context but {free / GB:.2f} GB is free on this GPU "
            f"(another process holds the rest): {shortfall_words(vram.high, limit, 'of VRAM')}; free the GPU, "
            f"or lower --batch-size (the largest batch that fits an idle {dev.name}: {vram.largest_batch:,})")
    return vram


def preset_of_this_gpu(gpu_name: str | None) -> str:
    """The device preset whose limits and advice fit this GPU: by its name, else the T4 (the smallest)."""
    return device_preset_name(gpu_name) or "t4"


def this_machine(preset: Device, staging, cuda_device=False) -> Device:
    """`preset` with this machine's limits: the RAM available plus what this process already holds of the
    budget (`ram_already_held`), the `staging` folder's free disk, and, for a CUDA job (`cuda_device` not
    False), this GPU's free VRAM plus the CUDA context (never part of what is free: `vram_needed`).
    """
    import psutil

    ram = psutil.virtual_memory().available + ram_already_held(preset.is_gpu, _cuda_initialized())
    vram = preset.vram_bytes if cuda_device is False else _free_vram(cuda_device) + preset.cuda_context_bytes
    return dataclasses.replace(preset, name=f"this machine ({preset.name})", ram_bytes=int(ram),
                               vram_bytes=int(vram), disk_bytes=int(_disk_free(staging)))


def ram_already_held(gpu_job: bool, cuda_initialized: bool) -> int:
    """The runtime RAM this process holds before the job: the host side of CUDA only once it started.

    A GPU job's budget counts RUNTIME_RAM_CUDA; before CUDA is initialized the process holds only
    the CPU runtime, and the rest is still to come, so it must fit in what is available now.
    """
    return RUNTIME_RAM_CUDA if gpu_job and cuda_initialized else RUNTIME_RAM_CPU


def vram_needed(total_vram: int, context_bytes: int) -> int:
    """VRAM the job still needs beside what torch.cuda.mem_get_info() reports free.

    mem_get_info() creates the CUDA context when there is none, and reports free memory after
    it: the context is never part of what is free, so it is never charged against it.
    """
    return total_vram - context_bytes


def _check_ram(budget: Budget) -> None:
    """The budget's RAM against this machine's (`this_machine`: available + what this process holds)."""
    need, limit = budget.totals["ram"], budget.limits["ram"]
    if not fits(need, limit):
        biggest = max(budget.lines["ram"], key=lambda line: line.bytes)
        raise BudgetExceeded(
            f"the encode job needs {need / GB:.2f} GB of RAM but this machine has {limit / GB:.2f} GB for it "
            f"(available, plus what this process holds): {shortfall_words(need, limit, 'of RAM')} "
            f"(largest line: {biggest.name} {biggest.bytes / GB:.2f} GB); {_knobs(budget, 'ram', limit)}")


def _check_vram(budget: Budget) -> None:
    """The budget's VRAM against this GPU's (`this_machine`: free + the CUDA context)."""
    need, limit = budget.totals["vram"], budget.limits["vram"]
    if not fits(need, limit):
        context = budget.device.cuda_context_bytes
        raise BudgetExceeded(
            f"the encode job needs {vram_needed(need, context) / GB:.2f} GB of VRAM beside the CUDA context but "
            f"{(limit - context) / GB:.2f} GB is free: {shortfall_words(need, limit, 'of VRAM')}; "
            f"{_knobs(budget, 'vram', limit)}")


def _check_drive_limits(config: PipelineConfig, job: str) -> None:
    """Refuse a plan whose folder or daily uploads cross Drive's limits, with the number and the knob."""
    checks = (cache_folder_check(config),) if job == "cache" else (run_folder_check(config), upload_check(config))
    for check in checks:
        if check.crossed:
            raise BudgetExceeded(f"the {job} job: {check} (limit: {check.source}); or pass drive_limits=False")


def _knobs(budget: Budget, resource: str, limit: float) -> str:
    """The knobs that close the gap to `limit`, each with the value that fits, or why none does."""
    return advise_resource(budget, resource, limit).turns or f"more {resource}"


def _disk_free(folder) -> int:
    from nblib.disk import disk_free  # nblib.disk's, looked up per call: tests set a disk's free bytes there

    return disk_free(folder)


def _on_google_drive(folder: Path) -> bool:
    from nblib.env import on_google_drive

    return on_google_drive(folder)


def _same_filesystem(a: Path, b: Path) -> bool:
    from nblib.disk import existing_parent

    return os.stat(existing_parent(a)).st_dev == os.stat(existing_parent(b)).st_dev


def _gpu_name(cuda_device=None) -> str | None:
    import torch

    return torch.cuda.get_device_name(_cuda_index(cuda_device))


def _free_vram(cuda_device=None) -> int:
    import torch

    return torch.cuda.mem_get_info(_cuda_index(cuda_device))[0]


def _cuda_index(cuda_device) -> int:
    """The job's GPU (a torch.device or "cuda:N"), else the current one."""
    import torch

    if cuda_device is not None and torch.device(cuda_device).index is not None:
        return torch.device(cuda_device).index
    return torch.cuda.current_device()


def _cuda_initialized() -> bool:
    """True when this process has started CUDA (never starts it: torch is not imported for this)."""
    import sys

    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


def _cuda_available() -> bool:
    from nblib.env import cuda_available

    return cuda_available()
