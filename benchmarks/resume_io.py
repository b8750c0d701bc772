"""What a restart costs: resuming a completed, mirrored encode run, hashing every part vs reading metadata.

A real run (smoke model, 16 capsules, width 192, float32: parts weigh a few hundred MB) is encoded once with a
mirror folder, then resumed repeatedly, two ways:
  hash every part   encode(..., verify=True): every part hashed on both sides, as every resume did
  metadata only     encode(...): part.json, sizes and stat fingerprints (the default)
Before each resume the parts are dropped from the page cache (posix_fadvise DONTNEED, ours only),
so the reads hit the disk as they would hit Drive. Prints seconds and bytes read (/proc/self/io
rchar) per mode, medians over --repeats, and the ratio.

    python benchmarks/resume_io.py [--images 4096] [--dim 192] [--repeats 3] [--out DIR]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nblib.units import fmt_bytes  # noqa: E402

MODES = {"hash every part": True, "metadata only": False}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=4096)
    parser.add_argument("--dim", type=int, default=192, help="model width: more part bytes per image")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, help="folder for the cache and the run (default: a temporary one)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="resume-io-") as tmp:
        root = args.out or Path(tmp)
        run_dir, mirror, resume = prepare(root, args.images, args.dim)
        parts = sorted(p for side in (run_dir / "parts", mirror) for p in side.glob("part-*/*.npy"))
        one_side = sum(p.stat().st_size for p in parts if p.is_relative_to(mirror))
        n_parts = len({p.parent.name for p in parts})
        print(f"run: {args.images:,} images, {n_parts} parts per side, {fmt_bytes(one_side)} of "
              f"parts per side (local staging + mirror)")
        results: dict[str, list[tuple[float, int]]] = {mode: [] for mode in MODES}
        for _ in range(args.repeats):
            for mode, verify in MODES.items():
                evict(parts)
                results[mode].append(resume(verify))
    print(f"{'resume':<18} {'seconds':>9} {'bytes read':>12} {'of one side':>12}")
    medians = {}
    for mode, runs in results.items():
        seconds, read = statistics.median(s for s, _ in runs), statistics.median(r for _, r in runs)
        medians[mode] = seconds
        print(f"{mode:<18} {seconds:9.3f} {fmt_bytes(read):>12} {read / one_side:12.2%}")
    ratio = medians["hash every part"] / medians["metadata only"]
    print(f"ratio: a metadata-only resume takes 1/{ratio:.1f} of the time of one that hashes every part")


def prepare(root: Path, images: int, dim: int):
    """Populate a cache, encode it once with a mirror; (run dir, mirror, resume(verify) -> (s, rchar))."""
    import torch

    from nblib import encode as enc
    from nblib.cache import ShardedImageCache, populate
    from nblib.config import preset

    torch.set_num_threads(max(1, (os.cpu_count() or 1)))
    cache_dir, run_dir, mirror = root / "cache", root / "run", root / "mirror"
    if not (cache_dir / "manifest.json").exists():
        texts = [f"#{i} a restart reads metadata, not {i % 13} parts" for i in range(images)]
        populate(texts, cache_dir, image_size=64, shard_mb=8, workers=0, progress=False)
    cache = ShardedImageCache(cache_dir)
    config = preset("smoke").replace(batch_size=128, checkpoint_every=8, consolidate_every=1,
                                     out_dtype="float32", capsules=16, dim=dim)

    def resume(verify: bool) -> tuple[float, int]:
        before, started = rchar(), time.perf_counter()
        report = enc.encode(cache, run_dir, config, mirror_dir=mirror, progress=False, preflight=False,
                            verify=verify)
        seconds, read = time.perf_counter() - started, rchar() - before
        assert report.parts_encoded == 0, "a resume of a completed run must encode nothing"
        return seconds, read

    started = time.perf_counter()
    first = enc.encode(cache, run_dir, config, mirror_dir=mirror, progress=False, preflight=False)
    print(f"first run: {first.parts_encoded} parts in {time.perf_counter() - started:.0f} s")
    resume(False)                                   # imports and lazy set-up are not a resume's cost
    return run_dir, mirror, resume


def evict(paths: list[Path]) -> None:
    """Drop these files from the page cache, so the next read goes to the disk."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def rchar() -> int:
    with open("/proc/self/io") as f:
        return int(dict(line.split(": ") for line in f.read().splitlines())["rchar"])


if __name__ == "__main__":
    main()
