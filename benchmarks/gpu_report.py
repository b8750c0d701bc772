"""The GPU half, measured: throughput, MFU, budget accuracy, VRAM drift, offload, precision, a T4 projection.

    PYTHONPATH=. python benchmarks/gpu_report.py            # one GPU, < 8 min -> benchmarks/results/<gpu>-<date>.json
    PYTHONPATH=. python benchmarks/gpu_report.py --smoke    # every step on CPU, tiny shapes, < 1 min
    PYTHONPATH=. python benchmarks/gpu_report.py --compile-modes default,max-autotune --out /tmp/r
    PYTHONPATH=. python benchmarks/gpu_report.py --simulate  # the same sections from the simulated T4
    PYTHONPATH=. python benchmarks/gpu_report.py --against benchmarks/results/simulated-t4-<date>.json

One process runs every step in order and writes one JSON (every section is always there, with a
"status": "ok", "skipped: no CUDA", "skipped: time budget" or "error: ..."), then prints a table:
throughput at the reference shapes (seed_t4, batch 192, and the largest batch the budget allows)
for fp32 / fp16 / bf16 autocast x SDPA backends x torch.compile; the speed candidates (compile,
SDPA backend, channels_last patch embedding, pinned loader) and which is fastest within a
tolerance; the budget's VRAM lines against measured peaks; allocated memory over >= 1,000 batches
of the streaming encode and its slope; async offload against consolidate-every-K; streaming
against a bare forward; fp16/bf16 against fp32; a roofline projection to a T4 (labelled as one);
and the same encode capped to a T4's 15 GB against the budget's verdict. `--simulate` writes the
sections a simulation can fill from nblib.simulate's T4 (every figure labelled simulated), and a
later real run given `--against` that file prints measured / simulated beside each figure. The
steps are one list (`STEPS`): each names the sections it reads, and its own summary line; the
long run is capped by the measured rate, so the whole report stays under 8 minutes on a T4.
Device figures come from nblib.budget.DEVICES, the roofline from nblib.simulate. Trade-off: one process
is fast and sees the allocator as a real run does, but earlier steps leave allocator state behind,
so every memory figure is a delta from a state cleared with empty_cache, or says it is absolute.
Needs only torch, numpy, psutil (and pillow through the cache renderer).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil
import torch

from nblib import budget, reference, t4_speed
from nblib.atomic import atomic_write_json, sha256_json
from nblib.config import preset
from nblib.lab import memory_budgeting
from nblib.measure import synchronize as _sync
from nblib.sdpa import SDPA_BACKENDS, sdpa_context
from nblib.trm import COMPILE_MODES, TRMVisionEncoder
from nblib.units import fmt_exception

SCHEMA = "nblib.gpu_report/1"
RESULTS = Path(__file__).resolve().parent / "results"
REFERENCE_T4_FP32_SAMPLES_PER_S = reference.ANALYSIS["samples per second"].value   # seed_t4, Colab T4, fp32, batch 192
TOLERANCE = 0.03                         # candidates within 3% of the fastest are "as fast"
MB = 1e6
ROW_SECONDS = 1.0                        # a throughput timing aims at ~1 s (big batches: fewer calls)
COMPILE_SECONDS_GUESS = 60.0             # inductor on the reference model, until one compile was timed
SMOKE_BATCH = 8                          # --smoke: the smoke preset at batch 8, so 2 busy cores finish in seconds
LONG_RUN_SECONDS = 120.0                 # the long run's share of the 8 minutes, at the measured rate
LONG_RUN_MIN_BATCHES = 100               # below this a drift slope means little: the run says so


def gpu_preset(device_name: str) -> budget.Device | None:
    """The nblib.budget.DEVICES entry of a GPU by its CUDA name; None for a GPU without a preset."""
    name = budget.device_preset_name(device_name)
    return budget.device_preset(name) if name else None


# ------------------------------------------------------------------------------ the run


@dataclass
class Context:
    """What every step shares: the device, the reference config and batches, a cache, the clock."""

    smoke: bool
    device: torch.device
    device_name: str
    gpu: budget.Device | None     # this GPU's preset (datasheet peaks, bandwidth), None: unknown or CPU
    config: object                # the reference PipelineConfig
    ref_batch: int
    max_batch: int
    long_batches: int
    compile_modes: tuple[str, ...]
    repeats: int
    timed_batches: int
    deadline: float
    work: Path
    cache: object = None
    simulate: bool = False

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def precisions(self) -> tuple[str, ...]:
        bf16 = bf16_native(torch) if self.cuda else True   # a T4 emulates bf16: not a candidate
        return ("fp32", "fp16", "bf16") if bf16 else ("fp32", "fp16")

    @property
    def default_precision(self) -> str:
        """What `encode` runs by default: fp16 autocast on CUDA, fp32 on CPU."""
        return "fp16" if self.cuda else "fp32"

    def seconds_left(self) -> float:
        return self.deadline - time.perf_counter()


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.simulate:
        return simulate_main(args)
    if not args.smoke and not torch.cuda.is_available():
        print("gpu_report.py: error: no CUDA device here; run with --smoke for the CPU dry run", file=sys.stderr)
        return 2
    if args.threads or args.smoke:
        torch.set_num_threads(args.threads or 1)   # 2 busy cores: one thread is 10-30x faster than two spinning
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu-report-") as tmp:
        ctx = make_context(args, Path(tmp), started)
        report = {"schema": SCHEMA, "smoke": ctx.smoke,
                  "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        for step in STEPS:
            report[step.name] = run_step(step, ctx, {r: report[r] for r in step.reads})
            print_section(step.name, report[step.name], flush=True)
    report["seconds"] = round(time.perf_counter() - started, 1)
    path = output_path(args.out, ctx)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, _jsonable(report))
    print(f"\n{summary_table(report)}\n\nwrote {path} in {report['seconds']:.0f} s")
    if args.against:
        print("\n" + "\n".join(against_simulated(report, json.loads(Path(args.against).read_text()))))
    return 0


def make_context(args, work: Path, started: float) -> Context:
    """The device, reference config and batch sizes of this run (smoke: the tiny preset on CPU)."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    config = preset("smoke").replace(batch_size=SMOKE_BATCH) if args.smoke else preset("seed_t4")
    ref = config.run.batch_size
    ctx = Context(smoke=args.smoke, device=device, device_name=name, gpu=gpu_preset(name) if cuda else None,
                  config=config, ref_batch=ref, max_batch=ref,
                  long_batches=args.long_batches or (30 if args.smoke else 1000),
                  compile_modes=args.compile_modes,
                  repeats=args.repeats or (1 if args.smoke else 3), timed_batches=2 if args.smoke else 10,
                  deadline=started + args.budget_s, work=work)
    ctx.max_batch = largest_batch(ctx)
    return ctx


def largest_batch(ctx: Context) -> int:
    """budget.max_batch_size on this GPU (on CPU: the budget's answer, capped at 2x the smoke batch)."""
    largest = budget.max_batch_size(ctx.config, budget_device(ctx))
    return min(largest, 2 * ctx.ref_batch) if ctx.smoke else largest


def run_step(step: Step, ctx: Context, inputs: dict) -> dict:
    """One step's section from the sections it reads: its numbers and status; a failure is recorded."""
    if step.needs_cuda and not ctx.cuda:
        return {"status": "skipped: no CUDA"}
    if not ctx.smoke and ctx.seconds_left() < step.min_seconds:
        return {"status": f"skipped: time budget ({ctx.seconds_left():.0f} s left, needs ~{step.min_seconds} s)"}
    started = time.perf_counter()
    try:
        section = {"status": "ok", **step.run(ctx, inputs)}
    except Exception as exc:  # a report records what failed and goes on
        section = {"status": f"error: {fmt_exception(exc, with_type=True)}"}
    finally:
        _free_device_memory()
    section["seconds"] = round(time.perf_counter() - started, 2)
    return section


# ------------------------------------------------------------------------------ environment


def step_environment(ctx: Context, inputs: dict) -> dict:
    env = {"device": str(ctx.device), "device_name": ctx.device_name, "torch": torch.__version__,
           "torch_threads": torch.get_num_threads(),
           "python": platform.python_version(), "cpu_count": os.cpu_count(),
           "ram_bytes": psutil.virtual_memory().total, "git_commit": _git_commit(),
           "preset": dataclasses.asdict(ctx.gpu) if ctx.gpu else None,
           "reference_config": ctx.config.name, "model": ctx.config.to_dict()["model"],
           "reference_batch": ctx.ref_batch, "max_batch": ctx.max_batch,
           "max_batch_note": ("budget.max_batch_size on this GPU (10% margin)" if ctx.cuda else
                              "budget.max_batch_size capped at 2x the smoke batch"),
           "flops_per_image": budget.flops_per_image(ctx.config.model),
           "bf16": "bf16" in ctx.precisions}
    if ctx.cuda:
        props = torch.cuda.get_device_properties(ctx.device)
        env.update(cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version(),
                   capability=f"{props.major}.{props.minor}", vram_bytes=props.total_memory,
                   tf32_matmul=torch.backends.cuda.matmul.allow_tf32,
                   tf32_cudnn=torch.backends.cudnn.allow_tf32, driver=_nvidia_smi("driver_version"))
    ctx.cache = build_cache(ctx)
    env["cache_images"] = len(ctx.cache)
    return env


def build_cache(ctx: Context):
    """A real cache of 2 reference batches, rendered by nblib.cache.populate; longer runs cycle it."""
    from nblib.cache import ShardedImageCache, populate

    n = 2 * ctx.ref_batch
    texts = [f"gpu report sample {i}: the quick brown fox jumps over the lazy dog, {i * 7919 % 1000}"
             for i in range(n)]
    folder = ctx.work / "cache"
    populate(texts, folder, ctx.config.model.image_size, shard_mb=16, workers=0 if ctx.smoke else None,
             progress=False)
    return ShardedImageCache(folder)


class CycledImages:
    """An image source of `n` images that repeats a small cache: image i is cache[i % len(cache)]."""

    complete = True

    def __init__(self, cache, n: int):
        self.cache, self.n = cache, n

    @property
    def image_size(self) -> int:
        return self.cache.image_size

    @property
    def fingerprint(self) -> str:
        inner = self.cache.fingerprint
        return sha256_json({"cycled": inner() if callable(inner) else inner, "n": self.n})

    def __len__(self) -> int:
        return self.n

    def get_batch(self, start: int, stop: int) -> np.ndarray:
        m, pieces = len(self.cache), []
        while start < stop:
            offset = start % m
            take = min(stop - start, m - offset)
            pieces.append(self.cache.get_batch(offset, offset + take))
            start += take
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)


# ------------------------------------------------------------------------------ throughput


def step_throughput(ctx: Context, inputs: dict) -> dict:
    """samples/s and MFU per (batch, precision, SDPA backend), eager; backends at the reference batch."""
    encoder = make_encoder(ctx)
    rows = []
    for batch in dict.fromkeys((ctx.ref_batch, ctx.max_batch)):
        images = device_images(ctx, batch)
        for precision in ctx.precisions:
            backends = (None, *SDPA_BACKENDS) if batch == ctx.ref_batch else (None,)
            for backend in backends:
                if not ctx.smoke and ctx.seconds_left() < ROW_SECONDS * 4:
                    rows.append(_row(images, precision, backend, None,
                                     error=f"skipped: time budget ({ctx.seconds_left():.0f} s left)"))
                    continue
                rows.append(measure_rate(ctx, encoder, images, precision=precision, sdpa_backend=backend))
        del images
        _free_device_memory()
    return {"rows": rows, "timed_batches": ctx.timed_batches, "repeats": ctx.repeats,
            "method": "best of `repeats` timings of `timed_batches` encoder.encode calls on a batch "
                      "already on the device, after 2 warm-up calls; MFU = samples/s x budget.flops_per_image "
                      "/ the peak the kernels run at (fp16/bf16 tensor cores; fp32: TF32 when "
                      "torch.backends.cuda.matmul.allow_tf32, else fp32; cudnn.allow_tf32 puts the "
                      "channels_last convolution on TF32 where the GPU has it)"}


def step_throughput_compiled(ctx: Context, inputs: dict) -> dict:
    """torch.compile per precision at the reference batch (smoke: dynamo with the eager backend, fp32)."""
    encoder = make_encoder(ctx)
    images = device_images(ctx, ctx.ref_batch)
    backend = "eager" if ctx.smoke else "inductor"
    precisions = ("fp32",) if ctx.smoke else (ctx.default_precision,) + tuple(
        p for p in ctx.precisions if p != ctx.default_precision)
    rows, expected = [], COMPILE_SECONDS_GUESS
    for mode in ctx.compile_modes:
        for precision in precisions:
            if not ctx.smoke and ctx.seconds_left() < expected:
                why = f"skipped: time budget ({ctx.seconds_left():.0f} s left, a compile ~{expected:.0f} s)"
                rows.append(_row(images, precision, None, mode, error=why))
                continue
            _reset_dynamo()
            rows.append(measure_rate(ctx, encoder, images, precision=precision, compile_mode=mode,
                                     compile_backend=backend))
            expected = max(expected, 1.2 * (rows[-1]["first_call_s"] or 0))
    return {"rows": rows, "compile_backend": backend}


def measure_rate(ctx: Context, encoder, images, **options) -> dict:
    """One throughput row: samples/s, ms per batch, MFU, the first call's seconds; or the error."""
    options = {"precision": "fp32", "sdpa_backend": None, "compile_mode": None, **options}
    row = _row(images, options["precision"], options["sdpa_backend"], options["compile_mode"])
    try:
        encoder.set_inference(**options)
        started = time.perf_counter()
        _run_batches(ctx, encoder, [images])
        row["first_call_s"] = round(time.perf_counter() - started, 3)
        per_call = _run_batches(ctx, encoder, [images])
        n, repeats = timing_plan(ctx, per_call)
        seconds = min(_run_batches(ctx, encoder, [images] * n) for _ in range(repeats))
        row["ms_per_batch"] = 1000 * seconds / n
        row["samples_per_s"] = images.shape[0] * n / seconds
        row["timed"] = f"best of {repeats} x {n} batches"
        row["mfu"] = mfu(ctx, row["samples_per_s"], options["precision"])
    except Exception as exc:  # an unavailable kernel or an OOM is a result, not a crash
        row["error"] = fmt_exception(exc, with_type=True)
        _free_device_memory()
    finally:
        encoder.set_inference(precision="auto", sdpa_backend=None, compile_mode=None,
                              compile_backend="inductor", channels_last_patch_embed=False)
    return row


def timing_plan(ctx: Context, per_call_s: float) -> tuple[int, int]:
    """(batches per timing, timings): up to timed_batches x repeats, about ROW_SECONDS per timing on a GPU."""
    if ctx.smoke:
        return ctx.timed_batches, ctx.repeats
    n = max(1, min(ctx.timed_batches, int(ROW_SECONDS / max(per_call_s, 1e-6))))
    return n, (ctx.repeats if n * per_call_s * ctx.repeats <= 3 * ROW_SECONDS else 1)


def mfu(ctx: Context, samples_per_s: float, precision: str) -> float | None:
    """Model FLOP utilization: achieved FLOP/s over the peak those kernels run at (None: unknown GPU or CPU)."""
    peak = peak_flops(ctx.gpu, precision, torch.backends.cuda.matmul.allow_tf32) if ctx.gpu else None
    return None if not peak else samples_per_s * budget.flops_per_image(ctx.config.model) / peak


def peak_flops(gpu: budget.Device, precision: str, tf32_matmul: bool) -> float:
    """The datasheet rate of this precision's GEMMs: tensor cores for fp16/bf16, TF32 when enabled."""
    if precision in ("fp16", "bf16"):
        return gpu.fp16_flops
    return gpu.tf32_flops if tf32_matmul and gpu.tf32_flops else gpu.fp32_flops


def _row(images, precision, backend, compile_mode, error=None) -> dict:
    return {"batch": int(images.shape[0]), "precision": precision, "sdpa_backend": backend or "default",
            "compile": compile_mode or "eager", "samples_per_s": None, "ms_per_batch": None, "mfu": None,
            "first_call_s": None, "error": error}


def _run_batches(ctx: Context, encoder, batches) -> float:
    _sync(ctx.device)
    started = time.perf_counter()
    for images in batches:
        encoder.encode(images)
    _sync(ctx.device)
    return time.perf_counter() - started


# ------------------------------------------------------------------------------ speed candidates


def step_candidates(ctx: Context, inputs: dict) -> dict:
    """The opt-in speed knobs at the reference batch and default precision; the fastest within tolerance."""
    precision = ctx.default_precision
    rows = [r for r in inputs["throughput"].get("rows", []) + inputs["throughput_compiled"].get("rows", [])
            if r["batch"] == ctx.ref_batch and r["precision"] == precision]
    named = {_candidate_name(r): r["samples_per_s"] for r in rows}
    encoder = make_encoder(ctx)
    images = device_images(ctx, ctx.ref_batch)
    channels_last = measure_rate(ctx, encoder, images, precision=precision, channels_last_patch_embed=True)
    named["channels_last patch embed"] = channels_last["samples_per_s"]
    rates = {k: v for k, v in named.items() if v}
    verdict = fastest_within_tolerance(rates, "default")
    if ctx.smoke:
        verdict["recommendation"] = f"SMOKE (CPU, tiny shapes): not a basis for defaults; {verdict['recommendation']}"
    loader = compare_pinned_loader(ctx, encoder) if ctx.cuda else {"status": "skipped: no CUDA"}
    errors = {_candidate_name(r): r["error"] for r in rows if r.get("error")}
    if channels_last.get("error"):
        errors["channels_last patch embed"] = channels_last["error"]
    return {"precision": precision, "batch": ctx.ref_batch, "samples_per_s": named, "tolerance": TOLERANCE,
            **verdict, "loader": loader, "errors": errors}


def fastest_within_tolerance(rates: dict[str, float], default: str) -> dict:
    """The fastest candidate, those within TOLERANCE of it, and whether today's default is among them."""
    if not rates:
        return {"fastest": None, "within_tolerance": [], "recommendation": "nothing measured"}
    best = max(rates, key=rates.get)
    close = sorted((k for k, v in rates.items() if v >= rates[best] * (1 - TOLERANCE)), key=lambda k: -rates[k])
    if default in close:
        advice = f"keep today's default: it is within {TOLERANCE:.0%} of the fastest ({best})"
    elif default in rates:
        advice = (f"{best} is {rates[best] / rates[default] - 1:.0%} faster than today's default: make it the "
                  f"default in nblib.trm.InferenceOptions once the precision section shows its outputs are close")
    else:
        advice = f"{best} is fastest; today's default was not measured"
    return {"fastest": best, "within_tolerance": close, "recommendation": advice}


def compare_pinned_loader(ctx: Context, encoder) -> dict:
    """Host -> device copy + encode per batch, from pinned against pageable host memory."""
    host = torch.from_numpy(ctx.cache.get_batch(0, ctx.ref_batch))
    rates = {}
    for name, batch in (("pageable", host), ("pinned", host.pin_memory())):
        def run(b=batch):
            return _run_batches(ctx, encoder, (b.to(ctx.device, non_blocking=True) for _ in range(ctx.timed_batches)))
        run()
        rates[name] = ctx.ref_batch * ctx.timed_batches / min(run() for _ in range(ctx.repeats))
    return {"samples_per_s": rates, **fastest_within_tolerance(rates, "pinned")}


def _candidate_name(row: dict) -> str:
    if row["compile"] != "eager":
        return f"compile={row['compile']}"
    if row["sdpa_backend"] != "default":
        return f"sdpa={row['sdpa_backend']}"
    return "default"


# ------------------------------------------------------------------------------ budget accuracy


def step_budget_accuracy(ctx: Context, inputs: dict) -> dict:
    """The budget's memory lines against measured peaks at three batch sizes (VRAM on CUDA, RSS on CPU)."""
    sizes = sorted({max(1, ctx.ref_batch // 4), ctx.ref_batch, ctx.max_batch})
    device = budget_device(ctx)
    rows = [measure_budget_lines(ctx, device, b) for b in sizes]
    return {"device": device.name, "memory": "CUDA allocator and driver" if ctx.cuda else "process RSS",
            "rows": rows, "method": "cfg.replace(batch_size=b, consolidate_every=1, checkpoint_every=1); "
            "one warm-up pass, then the second pass's peak; allocated/reserved are deltas from an emptied "
            "allocator, the driver figure is absolute (mem_get_info: total - free)"}


def measure_budget_lines(ctx: Context, device, batch: int) -> dict:
    cfg = ctx.config.replace(batch_size=batch, consolidate_every=1, checkpoint_every=1)
    predicted = budget.predict_budget(cfg, device)
    measured = _measure_forward_memory(ctx, batch)
    forward = memory_budgeting.forward_peak(cfg, device)      # on CUDA the trace's answer, on a CPU the RAM lines
    pairs = [("forward peak over weights + input", forward, measured["forward"])]
    if ctx.cuda:   # RSS cannot resolve a few MB of weights or input; the CUDA allocator counts them exactly
        pairs += vram_pairs(predicted, measured)
    return {"batch": batch, "fits": predicted.fits, "lines": [
        {"name": n, "predicted": p, "measured": m, "ratio": (m / p if m is not None and p else None)}
        for n, p, m in pairs]}


# the traced VRAM lines (nblib.budget.model_vram.ModelVRAM, through predict_budget) held by the allocator at the peak
_ALLOCATED_LINES = ("parameters and buffers", "gradients, AdamW moments, GradScaler",
                    "input batch and activations at the peak", "cuBLAS workspace")


def vram_pairs(predicted, measured: dict) -> list[tuple[str, int, int | None]]:
    """(name, predicted, measured) of a budget's traced VRAM lines against `_measure_forward_memory` on CUDA."""
    lines = {ln.name: ln.bytes for ln in predicted.lines["vram"]}
    allocated = sum(v for k, v in lines.items() if k in _ALLOCATED_LINES)
    return [("parameters and buffers", lines["parameters and buffers"], measured["weights"]),
            ("input, activations and cuBLAS workspace at the peak",
             lines["input batch and activations at the peak"] + lines["cuBLAS workspace"],
             measured["max_allocated"] - measured["weights"]),
            ("allocated at peak (max_memory_allocated)", allocated, measured["max_allocated"]),
            ("reserved at peak (+ allocator cache)", allocated + lines["allocator cache"], measured["max_reserved"]),
            ("CUDA context (driver - reserved)", lines["CUDA context"], measured["context"]),
            ("VRAM total (mem_get_info)", predicted.totals["vram"], measured["driver_used"]),
            ("VRAM total (nvidia-smi)", predicted.totals["vram"], measured["nvidia_smi_used"])]


def _measure_forward_memory(ctx: Context, batch: int) -> dict:
    """Bytes: weights, input, forward peak over both, outputs, and on CUDA the allocator and driver figures."""
    from nblib.measure import PeakMemory, pin_malloc_mmap_threshold

    pin_malloc_mmap_threshold()
    _free_device_memory()
    def read():
        return torch.cuda.memory_allocated(ctx.device) if ctx.cuda else psutil.Process().memory_info().rss
    base = read()
    base_reserved = torch.cuda.memory_reserved(ctx.device) if ctx.cuda else 0
    encoder = make_encoder(ctx)
    after_weights = read()
    images = device_images(ctx, batch)
    after_input = read()
    encoder.encode(images)                      # warm-up: kernels and workspaces sized for this batch
    _sync(ctx.device)
    gc.collect()
    before = read()
    if ctx.cuda:
        torch.cuda.reset_peak_memory_stats(ctx.device)
    with PeakMemory(cuda_device=ctx.device if ctx.cuda else None) as pm:
        out = encoder.encode(images)
        _sync(ctx.device)
    got = {"weights": after_weights - base, "input": after_input - after_weights}
    if not ctx.cuda:
        return {**got, "forward": pm.delta}
    free, total = torch.cuda.mem_get_info(ctx.device)
    reserved_now = torch.cuda.memory_reserved(ctx.device)
    got.update(forward=torch.cuda.max_memory_allocated(ctx.device) - before, outputs=read() - before,
               max_allocated=torch.cuda.max_memory_allocated(ctx.device) - base,
               max_reserved=torch.cuda.max_memory_reserved(ctx.device) - base_reserved,
               driver_used=total - free, context=(total - free) - reserved_now,
               nvidia_smi_used=_nvidia_smi_used_bytes())
    del out
    return got


def budget_device(ctx: Context):
    """The budget's Device for this machine: its preset (with this host's RAM and VRAM), else built from
    what torch reports (an unknown GPU: peaks unknown, the T4's context assumption).
    """
    if not ctx.cuda:
        return budget.device_preset("cpu")
    props = torch.cuda.get_device_properties(ctx.device)
    base = ctx.gpu or budget.device_preset("t4")
    return dataclasses.replace(base, name=ctx.device_name if not ctx.gpu else base.name,
                               vram_bytes=props.total_memory, ram_bytes=psutil.virtual_memory().total,
                               disk_bytes=shutil.disk_usage(ctx.work).free,
                               compute_capability=props.major * 10 + props.minor)


# ------------------------------------------------------------------------------ long run, offload, streaming


def step_long_run_vram(ctx: Context, inputs: dict) -> dict:
    """Allocated memory before every batch of a long streaming encode (parts + mirror); its slope."""
    from nblib.encode import encode

    cfg = ctx.config
    batches, why = long_run_batches(ctx.long_batches, _default_rate(ctx, inputs["throughput"]), cfg.run.batch_size,
                                    LONG_RUN_SECONDS if ctx.smoke else min(LONG_RUN_SECONDS, ctx.seconds_left() - 60))
    n = batches * cfg.run.batch_size
    source = CycledImages(ctx.cache, n)
    with BatchMemorySampler(ctx.device) as sampler:
        report = encode(source, ctx.work / "long", cfg, str(ctx.device), outputs=("checksums",),
                        mirror_dir=ctx.work / "long-mirror", progress=False, preflight=False,
                        do_consolidate=False)
    shutil.rmtree(ctx.work / "long", ignore_errors=True)
    shutil.rmtree(ctx.work / "long-mirror", ignore_errors=True)
    series = np.array(sampler.before, dtype=np.float64) / MB
    warm = min(len(series) // 10, 50)
    return {"batches": len(series), "batches_asked": ctx.long_batches, "batches_why": why,
            "batch_size": cfg.run.batch_size, "memory": sampler.what,
            "outputs": ["checksums"], "mirror": True, "samples_per_s": report.samples_per_s,
            "slope_mb_per_1000_batches": slope_per_1000(series[warm:]),
            "slope_all_mb_per_1000_batches": slope_per_1000(series),
            "warmup_batches_skipped": warm, "first_mb": float(series[0]), "last_mb": float(series[-1]),
            "min_mb": float(series.min()), "max_mb": float(series.max()),
            "peak_after_forward_mb": float(max(sampler.after) / MB),
            "series_mb": _downsample(series, 200)}


def long_run_batches(asked: int, samples_per_s: float | None, batch: int, seconds: float) -> tuple[int, str]:
    """Batches of the long run: those asked, or fewer so it lasts `seconds` at the measured rate."""
    if not samples_per_s:
        return asked, "as asked (no measured rate)"
    fit = int(max(0.0, seconds) * samples_per_s / batch)
    if fit >= asked:
        return asked, f"as asked ({asked * batch / samples_per_s:.0f} s at {samples_per_s:,.0f} samples/s)"
    n = max(fit, min(asked, 10))
    note = "" if n >= LONG_RUN_MIN_BATCHES else f"; under {LONG_RUN_MIN_BATCHES} batches the slope is weak"
    return n, f"capped to {seconds:.0f} s at the measured {samples_per_s:,.0f} samples/s{note}"


def _default_rate(ctx: Context, throughput: dict) -> float | None:
    return next((r["samples_per_s"] for r in throughput.get("rows", []) if r["batch"] == ctx.ref_batch
                 and r["precision"] == ctx.default_precision and r["sdpa_backend"] == "default"
                 and r["samples_per_s"]), None)


def slope_per_1000(series_mb: np.ndarray) -> float:
    """Least-squares slope of a per-batch series, in MB per 1,000 batches."""
    if len(series_mb) < 2:
        return 0.0
    return float(np.polyfit(np.arange(len(series_mb), dtype=np.float64), series_mb, 1)[0] * 1000)


class BatchMemorySampler:
    """Allocated CUDA memory (RSS on CPU) just before and after every TRMVisionEncoder forward.

    Global module hooks (torch.nn.modules.module.register_module_forward_*_hook) see the encoder
    that `encode` builds inside itself, so the public encode runs unchanged.
    """

    def __init__(self, device: torch.device):
        self.device, self.cuda = device, device.type == "cuda"
        cuda = self.cuda
        self.what = "torch.cuda.memory_allocated" if cuda else "process RSS"
        self.before: list[int] = []
        self.after: list[int] = []
        self._handles = []
        self._process = psutil.Process()

    def read(self) -> int:
        return torch.cuda.memory_allocated(self.device) if self.cuda else self._process.memory_info().rss

    def __enter__(self) -> BatchMemorySampler:
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        self._handles = [register_module_forward_pre_hook(self._pre), register_module_forward_hook(self._post)]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()

    def _pre(self, module, args):
        if isinstance(module, TRMVisionEncoder):
            self.before.append(self.read())

    def _post(self, module, args, output):
        if isinstance(module, TRMVisionEncoder):
            self.after.append(self.read())


def step_offload(ctx: Context, inputs: dict) -> dict:
    """Async per-batch offload against consolidate-every-K: samples/s and peak memory of each."""
    from nblib.measure import PeakMemory

    cfg = ctx.config
    n_batches = 8 if ctx.smoke else 2 * cfg.run.consolidate_every
    source = CycledImages(ctx.cache, n_batches * cfg.run.batch_size)
    modes = {mode: stream_once(ctx, source, mode, PeakMemory) for mode in ("async", "consolidate")}
    return {"batches": n_batches, "batch_size": cfg.run.batch_size, "consolidate_every": cfg.run.consolidate_every,
            "mirror": True, **modes,
            "faster": max(modes, key=lambda m: modes[m]["samples_per_s"])}


def stream_once(ctx: Context, source, offload: str, peak_memory) -> dict:
    from nblib.encode import encode

    _free_device_memory()
    run_dir, mirror = ctx.work / f"stream-{offload}", ctx.work / f"stream-{offload}-mirror"
    with peak_memory(cuda_device=ctx.device if ctx.cuda else None) as pm:
        report = encode(source, run_dir, ctx.config, str(ctx.device), offload=offload, mirror_dir=mirror,
                        progress=False, preflight=False, do_consolidate=False)
    shutil.rmtree(run_dir, ignore_errors=True)
    shutil.rmtree(mirror, ignore_errors=True)
    return {"samples_per_s": report.samples_per_s, "write_share": report.write_seconds / report.seconds,
            "peak_vram_allocated": pm.cuda_allocated_peak, "peak_vram_reserved": pm.cuda_reserved_peak,
            "peak_rss": pm.peak}


def step_streaming_overhead(ctx: Context, inputs: dict) -> dict:
    """The streaming encode (cache, loader, parts, mirror) against a bare forward on the same batches."""
    encoder = make_encoder(ctx)
    b = ctx.config.run.batch_size
    batches = [torch.from_numpy(ctx.cache.get_batch(s, s + b)).to(ctx.device) for s in range(0, len(ctx.cache), b)]
    n = max(ctx.timed_batches, 8)
    cycle = [batches[i % len(batches)] for i in range(n)]
    _run_batches(ctx, encoder, cycle[:2])
    bare = b * n / min(_run_batches(ctx, encoder, cycle) for _ in range(ctx.repeats))
    stream = inputs["offload"].get("async", {}).get("samples_per_s")   # the offload step's async run
    if not stream:
        from nblib.measure import PeakMemory

        stream = stream_once(ctx, CycledImages(ctx.cache, 8 * b), "async", PeakMemory)["samples_per_s"]
    return {"bare_samples_per_s": bare, "streaming_samples_per_s": stream, "ratio": stream / bare,
            "target": ">= 0.95", "precision": ctx.default_precision}


# ------------------------------------------------------------------------------ precision


def step_precision(ctx: Context, inputs: dict) -> dict:
    """fp16 / bf16 autocast outputs against fp32 on real cache images."""
    encoder = make_encoder(ctx)
    images = torch.from_numpy(ctx.cache.get_batch(0, ctx.ref_batch)).to(ctx.device)
    reference = {k: v.float() for k, v in encoder.set_inference(precision="fp32").encode(images).items()}
    rows = {}
    for precision in ctx.precisions[1:]:
        try:
            low = {k: v.float() for k, v in encoder.set_inference(precision=precision).encode(images).items()}
            rows[precision] = compare_outputs(low, reference)
        except Exception as exc:
            rows[precision] = {"error": fmt_exception(exc, with_type=True)}
    encoder.set_inference(precision="auto")
    return {"batch": ctx.ref_batch, "against": "fp32", **rows,
            "method": "relative error per capsule vector, ||low - fp32|| / ||fp32||; checksum bits are the "
                      "signs of the checksums"}


def compare_outputs(low: dict, ref: dict) -> dict:
    """Max and mean relative error of sketches and children; share of checksum sign bits that agree."""
    def rel(name):
        a, b = low[name].flatten(2 if name == "sketches" else 3), ref[name].flatten(2 if name == "sketches" else 3)
        return ((a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-12)).cpu()

    sketch, children = rel("sketches"), rel("children")
    bits = (low["checksums"] > 0) == (ref["checksums"] > 0)
    return {"sketch_max_rel_err": float(sketch.max()), "sketch_mean_rel_err": float(sketch.mean()),
            "children_max_rel_err": float(children.max()), "children_mean_rel_err": float(children.mean()),
            "checksum_bits_agree": float(bits.float().mean())}


# ------------------------------------------------------------------------------ T4 projection


def step_t4_projection(ctx: Context, inputs: dict) -> dict:
    """The simulated T4's roofline (a ceiling), nblib.t4_speed's range beside it, and this GPU's share of its own."""
    return t4_projection(ctx.config, ctx.ref_batch, ctx.gpu, ctx.device_name, inputs["throughput"])


def t4_projection(config, batch: int, gpu, gpu_name: str, throughput: dict) -> dict:
    """Roofline samples/s of a T4 per precision (a ceiling), nblib.t4_speed's sourced range beside it, and
    (on a GPU with a preset) the roofline scaled by the share of its own roofline this GPU reached.
    """
    from nblib.simulate import simulate_encode
    from nblib.simulate.roofline import calibrated_rate, roofline

    cfg = config.replace(batch_size=batch)
    t4 = {p: roofline(simulate_encode(cfg, "t4", precision=p, batches=1).kernels, batch, "t4")
          for p in ("fp32", "fp16")}
    out = {"label": "simulated (roofline of the simulated T4's kernels), not a measurement", "batch": batch,
           "method": PROJECTION_METHOD, "reference_t4_fp32_measured": REFERENCE_T4_FP32_SAMPLES_PER_S}
    for precision, roof in t4.items():
        out[precision] = {"flops_per_batch": roof.flops, "bytes_per_batch": roof.bytes,
                          "analytic_flops_per_batch": budget.flops_per_image(config.model) * batch,
                          "t4_roofline_samples_per_s": roof.samples_per_s,
                          "t4_speed_range": _t4_range(cfg, precision)}
        measured = next((r["samples_per_s"] for r in throughput.get("rows", []) if r["batch"] == batch
                         and r["precision"] == precision and r["sdpa_backend"] == "default"
                         and r["samples_per_s"]), None)
        own = None
        if measured and gpu is not None:
            own = roofline(simulate_encode(cfg, gpu, precision=precision, batches=1).kernels, batch, gpu)
        out[precision].update(measured_samples_per_s=measured, measured_on=gpu_name,
                              roofline_share_on_measured_gpu=measured / own.samples_per_s if own else None,
                              t4_calibrated_by_this_gpu=(calibrated_rate(roof, own, measured) if own else None))
    return out


PROJECTION_METHOD = (
    "nblib.simulate: the encoder's kernels on a fake T4 (efficient attention, as sm_75 runs it), FLOPs from "
    "torch.utils.flop_counter's formulas and bytes as every input read and every output written once; each "
    "kernel takes max(FLOPs / peak, bytes / bandwidth) on nblib.budget.DEVICES['t4'] (65 TFLOP/s fp16, 8.1 "
    "fp32, 320 GB/s): a ceiling. 't4_speed_range' is the T4's speed the suite quotes: nblib.t4_speed, the "
    "budget's FLOPs divided by the achieved FLOP/s range of public T4 measurements (a projection, with its "
    "sources); 'calibrated by this GPU' scales the roofline by the share of its own roofline the GPU measured "
    "here reached.")


def _t4_range(config, precision: str) -> dict:
    """The budget's T4 speed range (nblib.t4_speed) for `config` in `precision`: low, mid, high and the method.

    nblib.t4_speed from the budget's FLOPs per image, as predict_budget quotes it, without its VRAM trace.
    """
    speed = t4_speed.project(budget.flops_per_image(config.model), precision, n_samples=config.run.n_samples,
                             counted_by="flops_per_image from the TRM's shapes, FlopCounterMode's count to 0.1%")
    r = speed.samples_per_s
    return {"low": r.low, "mid": r.mid, "high": r.high, "label": speed.label, "method": speed.method}


# ------------------------------------------------------------------------------ capped memory


def step_capped_memory(ctx: Context, inputs: dict) -> dict:
    """The encode with the allocator capped to a T4's 15 GB: does the budget's verdict match the run?"""
    t4 = budget.device_preset("t4")
    cap = t4.vram_bytes - t4.cuda_context_bytes   # the allocator's share; the context lives outside it
    total = torch.cuda.get_device_properties(ctx.device).total_memory
    cfg = ctx.config.replace(consolidate_every=5, checkpoint_every=5)
    vram_only = dataclasses.replace(t4, ram_bytes=2**60)   # this host's RAM is not a T4's: test VRAM alone
    fit = budget.max_batch_size(cfg, vram_only, offload="consolidate")
    edge = budget.max_batch_size(cfg, vram_only, margin=0.0, offload="consolidate")
    rows = []
    for batch in dict.fromkeys((fit, edge + 1, int(edge * 1.25))):
        rows.append(capped_run(ctx, cfg.replace(batch_size=batch), t4, cap / total))
    return {"cap_bytes": cap, "fraction": cap / total, "consolidate_every": 5, "rows": rows,
            "all_agree": all(r["agree"] for r in rows), "attention": "efficient (forced, as a T4 runs it)",
            "carries_over_to_a_t4": ("VRAM only: attention is forced to the T4's kernel, but this GPU's "
                                     "allocator, workspaces and context are not a T4's"
                                     if not (ctx.gpu and ctx.gpu.name == "t4") else "yes: this is a T4"),
            "method": "torch.cuda.set_per_process_memory_fraction(cap / total); one part of 5 batches "
                      "(offload=consolidate) through nblib.encode.encode with sdpa_kernel(efficient); fits = "
                      "the budget's VRAM total <= the T4's 15 GB"}


def capped_run(ctx: Context, cfg, t4, fraction: float) -> dict:
    from nblib.encode import encode

    predicted = budget.predict_budget(cfg, t4, offload="consolidate")
    fits = predicted.totals["vram"] <= predicted.limits["vram"]
    source = CycledImages(ctx.cache, cfg.run.consolidate_every * cfg.run.batch_size)
    _free_device_memory()
    torch.cuda.reset_peak_memory_stats(ctx.device)
    torch.cuda.set_per_process_memory_fraction(fraction, ctx.device)
    oom, error = False, None
    try:
        with sdpa_context("efficient"):        # what a T4 (sm_75) runs; flash would need less memory
            encode(source, ctx.work / "capped", cfg, str(ctx.device), offload="consolidate", progress=False,
                   preflight=False, do_consolidate=False)
    except Exception as exc:
        oom, error = _is_oom(exc), fmt_exception(exc, with_type=True)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, ctx.device)
        shutil.rmtree(ctx.work / "capped", ignore_errors=True)
        peak = torch.cuda.max_memory_reserved(ctx.device)
        _free_device_memory()
    return {"batch": cfg.run.batch_size, "predicted_vram": predicted.totals["vram"], "budget_fits": fits,
            "oom": oom, "agree": fits != oom and (error is None or oom), "error": error,
            "max_reserved": peak}


def _is_oom(exc: BaseException | None) -> bool:
    while exc is not None:
        if isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower():
            return True
        exc = exc.__cause__ or exc.__context__
    return False


# ------------------------------------------------------------------------------ output


def output_path(out: str | None, ctx: Context) -> Path:
    """--out as a .json file or a folder; default benchmarks/results/ (GPU) or outputs/ (smoke)."""
    date = datetime.date.today().isoformat()
    name = f"{'smoke-' if ctx.smoke else ''}{_slug(ctx.device_name)}-{date}.json"
    if out:
        return Path(out) if out.endswith(".json") else Path(out) / name
    if ctx.smoke:
        from nblib.env import outputs_dir

        return outputs_dir() / "gpu_report" / name
    return RESULTS / name


def print_section(name: str, section: dict, flush: bool = True) -> None:
    print(f"[{name}] {section['status']} ({section.get('seconds', 0):.1f} s)", flush=flush)


def summary_table(report: dict) -> str:
    """The report as text: throughput rows, then each step's own summary line."""
    env_ = report["environment"]
    kind = "SIMULATED T4" if report.get("simulated") else ("SMOKE: tiny shapes" if report["smoke"] else "measured")
    lines = [f"GPU report on {env_.get('device_name')} ({kind}), "
             f"torch {env_.get('torch')}, config {env_.get('reference_config')}"]
    lines.append(f"{'batch':>6} {'precision':<9} {'sdpa':<10} {'compile':<14} {'samples/s':>11} "
                 f"{'ms/batch':>9} {'MFU':>6}")
    for name in ("throughput", "throughput_compiled"):
        for row in report[name].get("rows", []):
            rate = f"{row['samples_per_s']:,.1f}" if row["samples_per_s"] else (row["error"] or "-")[:40]
            ms = f"{row['ms_per_batch']:.2f}" if row["ms_per_batch"] else ""
            lines.append(f"{row['batch']:>6} {row['precision']:<9} {row['sdpa_backend']:<10} {row['compile']:<14} "
                         f"{rate:>11} {ms:>9} {_pct(row['mfu']):>6}")
    for step in STEPS:
        section = report[step.name]
        if step.summary is None:
            continue
        text = step.summary(section) if section["status"] == "ok" else section["status"]
        lines.append(f"{step.name:<20} {text}")
    return "\n".join(lines)


def _sum_environment(s: dict) -> str:
    return f"reference batch {s['reference_batch']}, largest batch {s['max_batch']} ({s['max_batch_note']})"


def _sum_budget_accuracy(s: dict) -> str:
    ratios = [f"b={r['batch']}: " + ", ".join(f"{ln['name'].split(' (')[0]} {ln['ratio']:.2f}" for ln in r["lines"]
                                              if ln["ratio"] is not None) for r in s["rows"]]
    return f"measured/predicted ({s['memory']}): " + " | ".join(ratios)


def _sum_long_run(s: dict) -> str:
    return (f"{s['batches']} batches ({s['batches_why']}), {s['memory']}: slope {s['slope_mb_per_1000_batches']:+.3f} "
            f"MB/1000 batches (all: {s['slope_all_mb_per_1000_batches']:+.3f}), {s['min_mb']:.0f}-{s['max_mb']:.0f} MB")


def _sum_offload(s: dict) -> str:
    def rate(m):
        return f"{s[m]['samples_per_s']:,.1f} samples/s" if s[m]["samples_per_s"] else "(no rate)"
    return ", ".join(f"{m} {rate(m)} peak VRAM {_mb(s[m]['peak_vram_allocated'])} RSS {_mb(s[m]['peak_rss'])}"
                     for m in ("async", "consolidate"))


def _sum_streaming(s: dict) -> str:
    return (f"streaming {s['streaming_samples_per_s']:,.1f} / bare {s['bare_samples_per_s']:,.1f} "
            f"samples/s = {s['ratio']:.3f} (target {s['target']})")


def _sum_precision(s: dict) -> str:
    return "; ".join(
        f"{p}: sketch rel err max {s[p]['sketch_max_rel_err']:.2e} mean {s[p]['sketch_mean_rel_err']:.2e}, "
        f"checksum bits agree {s[p]['checksum_bits_agree']:.2%}" if "error" not in s[p] else f"{p}: {s[p]['error']}"
        for p in ("fp16", "bf16") if p in s)


def _sum_projection(s: dict) -> str:
    def fmt(p):
        e = s[p]
        mine = e["t4_calibrated_by_this_gpu"]
        r = e["t4_speed_range"]
        return (f"{p} roofline {e['t4_roofline_samples_per_s']:,.0f}, projection (nblib.t4_speed) "
                f"{r['mid']:,.0f} ({r['low']:,.0f}-{r['high']:,.0f})" + (f", by this GPU {mine:,.0f}" if mine else "")
                + " samples/s")
    return f"SIMULATED T4 (batch {s['batch']}): {fmt('fp16')}; {fmt('fp32')}"


def _sum_capped(s: dict) -> str:
    return f"cap {_mb(s['cap_bytes'])}, {s['attention']}; carries over: {s['carries_over_to_a_t4']}: " + ", ".join(
        f"b={r['batch']} budget {'fits' if r['budget_fits'] else 'over'} run {'OOM' if r['oom'] else 'ok'}"
        f"{'' if r['agree'] else ' DISAGREE'}" for r in s["rows"])


def _sum_candidates(s: dict) -> str:
    loader = s["loader"].get("recommendation", s["loader"].get("status"))
    return f"fastest {s['fastest']}; {s['recommendation']}; loader: {loader}"


# ------------------------------------------------------------------------------ the steps, in order


@dataclass(frozen=True)
class Step:
    """One section of the report: how to make it, what it needs, the sections it reads, its summary."""

    name: str
    run: object                     # (ctx, inputs: {section name: section}) -> dict
    needs_cuda: bool = False
    min_seconds: float = 0          # skipped when less is left on a GPU
    reads: tuple[str, ...] = ()     # sections passed in as `inputs` (each made by an earlier step)
    summary: object = None          # (section) -> one line; None: shown in the throughput table


STEPS = (
    Step("environment", step_environment, summary=_sum_environment),
    Step("budget_accuracy", step_budget_accuracy, min_seconds=20, summary=_sum_budget_accuracy),
    Step("throughput", step_throughput, min_seconds=30),
    Step("long_run_vram", step_long_run_vram, min_seconds=60, reads=("throughput",), summary=_sum_long_run),
    Step("offload", step_offload, min_seconds=30, summary=_sum_offload),
    Step("streaming_overhead", step_streaming_overhead, min_seconds=10, reads=("offload",),
         summary=_sum_streaming),
    Step("precision", step_precision, min_seconds=5, summary=_sum_precision),
    Step("t4_projection", step_t4_projection, min_seconds=10, reads=("throughput",), summary=_sum_projection),
    Step("capped_memory", step_capped_memory, needs_cuda=True, min_seconds=30, summary=_sum_capped),
    Step("throughput_compiled", step_throughput_compiled, min_seconds=60),
    Step("candidates", step_candidates, min_seconds=10, reads=("throughput", "throughput_compiled"),
         summary=_sum_candidates),
)
STEP_NAMES = tuple(step.name for step in STEPS)


def check_steps(steps=STEPS) -> None:
    """Every section a step reads is made by an earlier step (the order is the data flow)."""
    made: set[str] = set()
    for step in steps:
        missing = [r for r in step.reads if r not in made]
        if missing:
            raise AssertionError(f"step {step.name} reads {missing} before any step makes them")
        made.add(step.name)


check_steps()


# ------------------------------------------------------------------------------ simulated T4, and against it


def simulate_main(args) -> int:
    """--simulate: the sections a simulation can fill, from nblib.simulate's T4; every figure simulated."""
    started = time.perf_counter()
    config = preset("smoke").replace(batch_size=SMOKE_BATCH) if args.smoke else preset("seed_t4")
    report = {"schema": SCHEMA, "smoke": args.smoke, "simulated": True,
              "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    sections = simulated_sections(config)
    for step in STEPS:
        report[step.name] = sections.get(step.name, {"status": "skipped: not simulated (needs a GPU)"})
        print_section(step.name, report[step.name])
    report["seconds"] = round(time.perf_counter() - started, 1)
    date = datetime.date.today().isoformat()
    name = f"{'smoke-' if args.smoke else ''}simulated-t4-{date}.json"
    path = Path(args.out) if args.out and args.out.endswith(".json") else (
        Path(args.out) / name if args.out else RESULTS / name)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, _jsonable(report))
    print(f"\n{summary_table(report)}\n\nwrote {path} in {report['seconds']:.0f} s")
    return 0


def simulated_sections(config) -> dict:
    """environment, budget_accuracy, throughput, offload, t4_projection, capped_memory of a simulated T4."""
    from nblib.simulate import simulate_encode

    t4, batch, label = budget.device_preset("t4"), config.run.batch_size, "simulated"
    env_ = {"status": "ok", "label": label, "device": "cuda:0 (fake)", "device_name": "T4 (simulated)",
            "torch": torch.__version__, "reference_config": config.name, "reference_batch": batch,
            "max_batch": budget.max_batch_size(config, t4),
            "max_batch_note": "budget.max_batch_size on a T4 (10% margin)", "preset": dataclasses.asdict(t4),
            "flops_per_image": budget.flops_per_image(config.model)}
    rows = []
    for b in sorted({max(1, batch // 4), batch, 2 * batch}):
        cfg = config.replace(batch_size=b, consolidate_every=1, checkpoint_every=1)
        sim = simulate_encode(cfg, t4, batches=2)
        predicted = budget.predict_budget(cfg, t4)
        allocator = predicted.totals["vram"] - t4.cuda_context_bytes
        rows.append({"batch": b, "fits": predicted.fits, "lines": [
            {"name": "reserved at peak (+ allocator cache)", "predicted": allocator, "measured": sim.max_reserved,
             "ratio": sim.max_reserved / allocator}]})
    throughput_rows = []
    for p in ("fp32", "fp16"):
        r = _t4_range(config, p)
        throughput_rows.append({**_row_dict(batch, p, r["mid"]), "low": r["low"], "high": r["high"],
                                "ms_per_batch": 1000 * batch / r["mid"],
                                "mfu": r["mid"] * budget.flops_per_image(config.model) / peak_flops(t4, p, False)})
    throughput = {"status": "ok", "label": label + " T4; rates: projection (nblib.t4_speed)", "rows": throughput_rows,
                  "method": "nblib.t4_speed through the budget: FLOPs per image / the achieved FLOP/s range of "
                            "public T4 measurements with their sources; samples_per_s is the range's mid"}
    offload = {"status": "ok", "label": label, "batch_size": batch}
    for mode in ("async", "consolidate"):
        sim = simulate_encode(config, t4, offload=mode)
        offload[mode] = {"samples_per_s": None, "peak_vram_allocated": sim.max_allocated,
                         "peak_vram_reserved": sim.max_reserved, "peak_rss": None}
    capped_cfg = config.replace(consolidate_every=5, checkpoint_every=5)
    cap = t4.vram_bytes - t4.cuda_context_bytes
    capped_rows = []
    for b in dict.fromkeys((batch, 2 * batch)):
        cfg = capped_cfg.replace(batch_size=b)
        sim = simulate_encode(cfg, t4, offload="consolidate")
        fits = budget.predict_budget(cfg, t4, offload="consolidate").totals["vram"] <= t4.vram_bytes
        over = sim.max_reserved > cap
        capped_rows.append({"batch": b, "budget_fits": fits, "oom": over, "agree": fits != over,
                            "max_reserved": sim.max_reserved})
    projection = t4_projection(config, batch, None, "T4 (simulated)", {"rows": []})
    return {"environment": env_,
            "budget_accuracy": {"status": "ok", "label": label, "device": "t4",
                                "memory": "simulated caching allocator", "rows": rows},
            "throughput": throughput,
            "offload": offload,
            "t4_projection": {"status": "ok", **projection},
            "capped_memory": {"status": "ok", "label": label, "cap_bytes": cap, "consolidate_every": 5,
                              "rows": capped_rows, "all_agree": all(r["agree"] for r in capped_rows),
                              "attention": "efficient (as a T4 runs it)",
                              "carries_over_to_a_t4": "a simulation of one: no context, no real allocator"}}


def _row_dict(batch: int, precision: str, rate: float) -> dict:
    return {"batch": batch, "precision": precision, "sdpa_backend": "default", "compile": "eager",
            "samples_per_s": rate, "ms_per_batch": None, "mfu": None, "first_call_s": None, "error": None}


def _eager_rate(precision: str):
    return lambda s: next((r["samples_per_s"] for r in s.get("rows", []) if r["precision"] == precision
                           and r["sdpa_backend"] == "default" and r["compile"] == "eager"), None)


def _reserved_at_reference(s: dict):
    return next((ln["measured"] for r in s.get("rows", [])[1:2] for ln in r["lines"]
                 if ln["name"].startswith("reserved")), None)


AGAINST = (   # (section, what, reader): the figures both a real and a simulated report hold
    ("throughput", "samples/s fp32 at the reference batch", _eager_rate("fp32")),
    ("throughput", "samples/s fp16 at the reference batch", _eager_rate("fp16")),
    ("offload", "max reserved VRAM, async", lambda s: s.get("async", {}).get("peak_vram_reserved")),
    ("offload", "max reserved VRAM, consolidate", lambda s: s.get("consolidate", {}).get("peak_vram_reserved")),
    ("budget_accuracy", "max reserved VRAM at the reference batch", _reserved_at_reference),
)


def against_simulated(report: dict, simulated: dict) -> list[str]:
    """Lines of measured / simulated for every figure both reports hold."""
    rows = [f"measured here / simulated T4 ({simulated.get('created', '?')}):"]
    for section, what, read in AGAINST:
        got = read(report[section]) if report.get(section, {}).get("status") == "ok" else None
        sim = read(simulated[section]) if simulated.get(section, {}).get("status") == "ok" else None
        ratio = f"{got / sim:.3f}" if got and sim else "-"
        rows.append(f"  {what:<44} measured {_num(got):>12}  simulated {_num(sim):>12}  ratio {ratio}")
    return rows


def _num(x) -> str:
    return "-" if x is None else (f"{x / MB:,.0f} MB" if x > 1e5 else f"{x:,.1f}")


def make_encoder(ctx: Context) -> TRMVisionEncoder:
    return TRMVisionEncoder(ctx.config, seed=ctx.config.run.seed).eval().to(ctx.device)


def device_images(ctx: Context, batch: int) -> torch.Tensor:
    """`batch` images from the cache (cycled), on the device."""
    return torch.from_numpy(CycledImages(ctx.cache, batch).get_batch(0, batch)).to(ctx.device)


def _free_device_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def smi_number(text: str | None) -> float | None:
    """One nvidia-smi CSV field as a number; None for "[N/A]", "[Not Supported]" or nothing.

    nvidia-smi prints [N/A] for fields it cannot read (MIG slices, restricted containers).
    """
    try:
        return float((text or "").strip())
    except ValueError:
        return None


def smi_device_id(cuda_visible_devices: str | None, torch_index: int = 0) -> str | None:
    """The id nvidia-smi -i takes for torch's cuda:<torch_index> under CUDA_VISIBLE_DEVICES.

    torch numbers the visible devices 0..n-1; nvidia-smi numbers all of them. The entry may be
    an index, a GPU-/MIG- UUID (nvidia-smi takes those too), or empty (no GPU visible).
    """
    if cuda_visible_devices is None:
        return str(torch_index)
    entries = [e.strip() for e in cuda_visible_devices.split(",") if e.strip()]
    return entries[torch_index] if torch_index < len(entries) else None


def bf16_native(torch_module) -> bool:
    """True when this GPU runs bf16 on hardware (sm_80+), not through fp32 emulation (a T4)."""
    cuda = torch_module.cuda
    if not cuda.is_available():
        return False
    try:
        return bool(cuda.is_bf16_supported(including_emulation=False))
    except TypeError:   # torch before 2.3: no emulation, the plain check is the hardware one
        return bool(cuda.is_bf16_supported())


def _nvidia_smi(field: str, torch_index: int | None = None) -> str | None:
    """One field of nvidia-smi for torch's device (its id under CUDA_VISIBLE_DEVICES); None when unreadable."""
    if shutil.which("nvidia-smi") is None:
        return None
    if torch_index is None:
        torch_index = torch.cuda.current_device() if torch.cuda.is_available() else 0
    index = smi_device_id(os.environ.get("CUDA_VISIBLE_DEVICES"), torch_index)
    if index is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader,nounits", "-i", index],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


def _nvidia_smi_used_bytes() -> int | None:
    used = smi_number(_nvidia_smi("memory.used"))   # MiB, or [N/A] on MIG / restricted containers
    return int(used * 2**20) if used is not None else None


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def _downsample(series: np.ndarray, n: int) -> list[float]:
    step = max(1, math.ceil(len(series) / n))
    return [round(float(v), 3) for v in series[::step]]


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "gpu"


def _pct(x) -> str:
    return f"{x:.1%}" if x is not None else "-"


def _mb(n) -> str:
    return f"{n / MB:,.0f} MB" if n is not None else "-"


def _jsonable(obj):
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items() if not str(k).startswith("_")}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, (np.floating, np.integer)):
        return obj.item()
    return obj


class _OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line and exits 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _reset_dynamo() -> None:
    import torch._dynamo

    torch._dynamo.reset()


def _compile_modes(text: str) -> tuple[str, ...]:
    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    unknown = [m for m in modes if m not in COMPILE_MODES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown compile mode(s) {unknown}; choose from {', '.join(COMPILE_MODES)}")
    return modes


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive integer")
    return value


def _parser() -> argparse.ArgumentParser:
    p = _OneLineParser(prog="gpu_report.py", description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="every step on CPU (or GPU) with the tiny smoke preset")
    p.add_argument("--simulate", action="store_true",
                   help="write the sections a simulation can fill from the simulated T4 (nblib.simulate)")
    p.add_argument("--against", help="a --simulate report: print measured / simulated beside each figure")
    p.add_argument("--out", help="a folder (the file is named <gpu>-<date>.json) or a .json path")
    p.add_argument("--budget-s", type=_positive_int, default=400,
                   help="seconds of the run after which steps and compiles that would not finish are skipped "
                        "(default 400, so the whole report stays under 8 min)")
    p.add_argument("--long-batches", type=_positive_int, help="batches of the long run (1000; smoke 30)")
    p.add_argument("--compile-modes", type=_compile_modes, default=("default",),
                   help="comma-separated torch.compile modes to measure ('' for none; max-autotune takes minutes)")
    p.add_argument("--threads", type=_positive_int, help="torch CPU threads (default: torch's; smoke 1)")
    p.add_argument("--repeats", type=_positive_int, help="timings per throughput row, best kept (3; smoke 2)")
    return p


if __name__ == "__main__":
    sys.exit(main())
