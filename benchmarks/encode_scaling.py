"""Encode scaling: samples/s of `python -m nblib encode` at 1 and N processes, and the efficiency.

    python benchmarks/encode_scaling.py                  # CPU: 1 and 2 processes (gloo), then GPUs if >= 2
    python benchmarks/encode_scaling.py --images 1024 --repeats 3
    python benchmarks/encode_scaling.py --skip-cpu       # GPUs only (nccl, one rank per GPU)

Every launch is a real `torchrun --standalone` of the CLI on one cache, into a fresh run folder.
The rate is read from the ranks' own records (run/ranks/*.json): samples encoded over the span
from the first rank's start to the last part written, so torch's import and the process group's
start-up (seconds on a busy machine) are left out, and the consolidation too. Efficiency is
rate(N) / (N x rate(1)), with the same threads per process on both sides; on CPU the row "1
process, all cores" is printed too, since N processes of 1 thread compete with it for the same
cores. The machine's core count (and GPU names) are printed beside the figures. Best of
`--repeats` for each row.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from nblib.cache import populate, sample_texts
from nblib.encode import distributed

REPO = Path(__file__).resolve().parents[1]


def launch_rate(cache_dir: Path, out: Path, nproc: int, device: str, threads: int, profile: str,
                batch_size: int, checkpoint_every: int) -> float:
    """samples/s of one torchrun launch of nproc ranks, from the ranks' records."""
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           "-m", "nblib", "encode", "--cache", str(cache_dir), "--out", str(out), "--profile", profile,
           "--batch-size", str(batch_size), "--checkpoint-every", str(checkpoint_every), "--device", device,
           "--no-progress", "--no-preflight"]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"launch failed ({' '.join(cmd)}):\n{done.stderr[-3000:]}")
    return records_rate(out, batch_size * checkpoint_every)


def records_rate(out: Path, part_samples: int) -> float:
    """Samples written by all ranks over (last write - first start), from run/ranks/*.json."""
    records = distributed.read_records(out)
    parts = sum(len(r["written"]) for r in records)
    span = max(r["updated"] for r in records) - min(r["started"] for r in records)
    return parts * part_samples / span


def best_rate(repeats: int, **kwargs) -> float:
    return max(launch_rate(**kwargs) for _ in range(repeats))


def cpu_rows(cache_dir: Path, work: Path, args) -> list[tuple[str, float]]:
    cores = os.cpu_count() or 1
    common = dict(cache_dir=cache_dir, out=work / "cpu", device="cpu", profile=args.profile,
                  batch_size=args.batch_size, checkpoint_every=args.checkpoint_every)
    one = best_rate(args.repeats, nproc=1, threads=1, **common)
    every = best_rate(args.repeats, nproc=1, threads=cores, **common)
    many = best_rate(args.repeats, nproc=args.nproc, threads=1, **common)
    print(f"\nCPU: {cores} cores (os.cpu_count), {args.images} images, profile {args.profile}, "
          f"batch {args.batch_size}, parts of {args.checkpoint_every} batches")
    rows = [("1 process x 1 thread", one), (f"1 process x {cores} threads (all cores)", every),
            (f"{args.nproc} processes x 1 thread", many)]
    _print(rows)
    print(f"  scaling efficiency {args.nproc} vs 1 (1 thread each): {many / (args.nproc * one):.0%}   "
          f"vs 1 process on all cores: x{many / every:.2f}")
    return rows


def gpu_rows(cache_dir: Path, work: Path, args) -> None:
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count < 2:
        print(f"\nGPU: {count} CUDA GPU(s) here; the GPU rows need at least 2 (one rank per GPU)")
        return
    names = sorted({torch.cuda.get_device_name(i) for i in range(count)})
    common = dict(cache_dir=cache_dir, out=work / "gpu", device="cuda", threads=4, profile=args.profile,
                  batch_size=args.batch_size, checkpoint_every=args.checkpoint_every)
    one = best_rate(args.repeats, nproc=1, **common)
    many = best_rate(args.repeats, nproc=count, **common)
    print(f"\nGPU: {count} x {', '.join(names)} (nccl, cuda:LOCAL_RANK), {os.cpu_count()} CPU cores")
    _print([("1 rank, 1 GPU", one), (f"{count} ranks, {count} GPUs", many)])
    print(f"  scaling efficiency {count} vs 1: {many / (count * one):.0%}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=512)
    p.add_argument("--profile", default="smoke", help="CLI profile of the model (smoke: 64 px)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--checkpoint-every", type=int, default=2)
    p.add_argument("--nproc", type=int, default=2, help="processes of the CPU row")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--skip-cpu", action="store_true")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="nblib-encode-scaling-"))
    try:
        from nblib.config import for_profile

        image_size = for_profile(args.profile).model.image_size
        cache_dir = work / "cache"
        populate(sample_texts(args.images), cache_dir, image_size, shard_mb=64, progress=False)
        if not args.skip_cpu:
            cpu_rows(cache_dir, work, args)
        gpu_rows(cache_dir, work, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def _print(rows: list[tuple[str, float]]) -> None:
    for label, rate in rows:
        print(f"  {label:<36} {rate:>10,.1f} samples/s")


if __name__ == "__main__":
    raise SystemExit(main())
