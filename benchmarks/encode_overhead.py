"""Streaming-encode overhead: `nblib.encode.encode` against the bare model forward, same batches.

    python benchmarks/encode_overhead.py               # CPU run, then seed_t4 shapes in fp16 on CUDA if present
    python benchmarks/encode_overhead.py --skip-cpu    # only the GPU run

Both sides see the same cache, the same fixed batches, the same encoder and device. The bare side
reads every batch into memory first and times only `encoder.encode` (plus a device sync); the
streaming side times the whole `encode` call minus consolidation: DataLoader, host copies,
float16 cast, part writes with fsync, manifest. Runs are interleaved and the best of `--repeats`
is kept for each, so a busy machine's noise hits both alike. Target: streaming / bare >= 0.95.
On a GPU it also prints the model FLOP utilization (FLOPs per image from nblib.budget) and the
ratio to the reference run's 94 samples/s (T4, fp32).
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

from nblib import budget, cache, encode, reference
from nblib.config import preset
from nblib.measure import synchronize as _sync
from nblib.models import load_model

REFERENCE_SAMPLES_PER_S = float(reference.ANALYSIS["samples per second"].value)  # seed_t4, T4, fp32


def cpu_config(workers: int = 0):
    """A CPU-sized model whose forward dominates the loop: 128 px, dim 256, 1.7 GFLOP/image.

    workers=0 by default: on a CPU the loader has no idle cores to run on, so reading the batch
    in the main process (a memcpy from the page cache) is the honest setting.
    """
    return preset("smoke").replace(name="cpu-bench", image_size=128, dim=256, heads=4, capsules=8,
                                   children=4, checksum_dim=32, batch_size=32, checkpoint_every=4,
                                   consolidate_every=1, workers=workers, prefetch=2)


def gpu_config():
    """seed_t4 shapes (224 px, dim 768, 12 capsules x 4 children, batch 192), parts of 5 batches."""
    return preset("seed_t4").replace(checkpoint_every=5, consolidate_every=5, workers=4)


def make_cache(folder: Path, n: int, image_size: int):
    """A real cache of `n` rendered sample texts."""
    cache.populate(cache.sample_texts(n), folder, image_size, shard_mb=64, progress=False)
    return cache.ShardedImageCache(folder)


def bare_forward(images, encoder, config, device) -> float:
    """samples/s of encoder.encode alone on the run's batches, already on the device."""
    plan = encode.plan_run(config, len(images))
    batches = [torch.from_numpy(images.get_batch(s, e)).to(device)
               for k in range(plan.n_parts) for s, e in plan.part_batches(k)]
    encoder.encode(batches[0])                       # warm-up: kernels, allocator
    _sync(device)
    started = time.perf_counter()
    for batch in batches:
        encoder.encode(batch)
    _sync(device)
    return len(images) / (time.perf_counter() - started)


def streaming(images, config, device, folder: Path) -> tuple[float, float, float]:
    """(samples/s of the encode loop, its share spent writing parts, seconds of consolidation)."""
    shutil.rmtree(folder, ignore_errors=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = encode.encode(images, folder, config, str(device), progress=False,
                               preflight=False, do_consolidate=False)
        started = time.perf_counter()
        encode.consolidate(folder)
    return report.samples_per_s, report.write_seconds / report.seconds, time.perf_counter() - started


def compare(images, config, device, folder: Path, repeats: int) -> dict:
    """Interleaved best-of-`repeats` rates of both sides, and their ratio."""
    encoder = load_model("trm", config=config).module.to(device).eval()
    bare, stream, write_share, consolidate_s = 0.0, 0.0, 0.0, float("inf")
    streaming(images, config, device, folder / "warm")   # warm-up: imports, page cache
    for _ in range(repeats):
        bare = max(bare, bare_forward(images, encoder, config, device))
        rate, share, seconds = streaming(images, config, device, folder / "run")
        if rate > stream:
            stream, write_share = rate, share
        consolidate_s = min(consolidate_s, seconds)
    return {"bare": bare, "stream": stream, "ratio": stream / bare, "write_share": write_share,
            "consolidate_s": consolidate_s}


def report(title: str, config, device, n: int, result: dict) -> None:
    flops = budget.flops_per_image(config.model)
    print(f"\n{title}: {n:,} images of {config.model.image_size} px, batch {config.run.batch_size}, "
          f"{config.run.workers} loader workers, "
          f"parts of {config.run.checkpoint_every} batches, outputs {'+'.join(config.run.outputs)} "
          f"{config.run.out_dtype}, {flops / 1e9:.2f} GFLOP/image, device {device}, "
          f"torch threads {torch.get_num_threads()}")
    print(f"  {'bare model forward':<34} {result['bare']:>10,.1f} samples/s")
    print(f"  {'streaming encode (loader+parts)':<34} {result['stream']:>10,.1f} samples/s")
    print(f"  {'ratio streaming / bare':<34} {result['ratio']:>10.3f}   (target >= 0.95)")
    print(f"  {'of streaming: writing parts':<34} {result['write_share']:>10.1%}   "
          f"(parts of {config.run.checkpoint_every * config.run.batch_size} images, fsynced)")
    print(f"  {'consolidate afterwards':<34} {result['consolidate_s']:>10.2f} s")
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        preset_name = budget.device_preset_name(name)
        peak = budget.DEVICES[preset_name].fp16_flops if preset_name else None
        mfu = (f"{result['stream'] * flops / peak:.1%} of {peak / 1e12:.0f} TFLOP/s fp16" if peak
               else "n/a (unknown GPU)")
        print(f"  {'GPU':<34} {name}")
        print(f"  {'model FLOP utilization (stream)':<34} {mfu}")
        print(f"  {'vs the reference 94 samples/s':<34} {result['stream'] / REFERENCE_SAMPLES_PER_S:>10.2f}x "
              f"(full run: {1_907_747 / result['stream'] / 3600:.2f} h; goal >= 3x)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=384, help="images in the CPU run")
    parser.add_argument("--workers", type=int, default=0, help="DataLoader workers in the CPU run")
    parser.add_argument("--gpu-n", type=int, default=3840, help="images in the GPU run (20 batches)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument("--skip-gpu", action="store_true", help="skip the seed_t4 run on CUDA")
    parser.add_argument("--skip-cpu", action="store_true")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="encode-overhead-") as tmp:
        tmp = Path(tmp)
        if not args.skip_cpu:
            config = cpu_config(args.workers)
            images = make_cache(tmp / "cache-cpu", args.n, config.model.image_size)
            result = compare(images, config, torch.device("cpu"), tmp / "cpu", args.repeats)
            report("CPU", config, torch.device("cpu"), len(images), result)
        if not args.skip_gpu:
            if not torch.cuda.is_available():
                print("\nGPU: no CUDA device here; the seed_t4 fp16 run is skipped")
                return 0
            config = gpu_config()
            images = make_cache(tmp / "cache-gpu", args.gpu_n, config.model.image_size)
            result = compare(images, config, torch.device("cuda"), tmp / "gpu", args.repeats)
            report("GPU, seed_t4 shapes, fp16 autocast", config, torch.device("cuda"), len(images), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
