"""Notebook 02's measurements and demos: render scaling by workers, read throughput, kill-and-resume.

The cache itself (format, populate, verify, reader) is `nblib.cache`; this module only measures it
and stages the live SIGKILL demo with a real `python -m nblib cache` process (`nblib.proc`).
"""
from __future__ import annotations

import shutil
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from nblib.cache import PopulateSummary, ShardedImageCache, populate, read_cache_manifest
from nblib.errors import CacheError


def texts_sharing_an_image(texts: Sequence[str], image_size: int) -> list[list[str]]:
    """Groups of distinct texts whose rendered images are byte-identical (what the encoder cannot tell apart)."""
    import hashlib

    from nblib.render import render_text

    by_image: dict[str, list[str]] = {}
    for text in dict.fromkeys(texts):
        digest = hashlib.sha256(render_text(text, image_size).tobytes()).hexdigest()
        by_image.setdefault(digest, []).append(text)
    return [group for group in by_image.values() if len(group) > 1]


def worker_scaling(texts, worker_counts: Sequence[int], folder: str | Path, image_size: int = 224,
                   shard_mb: float = 400, codec: str = "raw") -> list[PopulateSummary]:
    """Populate the same texts once per worker count into fresh subfolders; their summaries."""
    summaries = []
    for workers in worker_counts:
        target = Path(folder) / f"workers-{workers}"
        shutil.rmtree(target, ignore_errors=True)
        summaries.append(populate(texts, target, image_size, shard_mb, workers=workers,
                                  codec=codec, progress=False))
        shutil.rmtree(target, ignore_errors=True)
    return summaries


def read_throughput(images: ShardedImageCache, n_random: int = 500, batch_size: int = 64,
                    seed: int = 0) -> dict[str, float]:
    """Images/s reading a cache three ways: random `cache[i]`, `get_batch` runs, `iter_shards`.

    Every read includes the per-image xxh3 check the reader makes before serving an image.
    """
    rng = np.random.default_rng(seed)
    n = len(images)
    if n == 0:
        raise CacheError(f"{images.cache_dir} holds no images to read")
    indexes = rng.integers(0, n, size=min(n_random, 10 * n))
    images.close()
    start = time.perf_counter()
    for i in indexes:
        images[int(i)]
    random_s = time.perf_counter() - start
    images.close()
    start = time.perf_counter()
    for first in range(0, n, batch_size):
        images.get_batch(first, min(n, first + batch_size))
    batch_s = time.perf_counter() - start
    images.close()
    start = time.perf_counter()
    streamed = sum(len(shard) for shard in images.iter_shards())
    stream_s = time.perf_counter() - start
    return {"random cache[i]": len(indexes) / random_s,
            f"get_batch({batch_size}) in order": n / batch_s,
            "iter_shards (stream)": streamed / stream_s}


def cache_command(texts: str | Path, out: str | Path, **flags) -> list[str]:
    """The `python -m nblib cache` command line: cache_command(p, d, size=64, no_progress=True)."""
    from nblib.proc import cli_command

    return cli_command("cache", texts=texts, out=out, **flags)


def run_and_kill(command: list[str], cache_dir: str | Path, after_shards: int,
                 timeout: float = 300.0) -> int:
    """Run `command`, SIGKILL it (and its workers) once `after_shards` shard files exist.

    Returns how many shards the manifest listed at the kill; raises CacheError if the command
    ended on its own first (pick a larger cache or a smaller `after_shards`).
    """
    from nblib.proc import run_until, was_killed

    folder = Path(cache_dir)
    code = run_until(command, lambda: len(list(folder.glob("shard-*"))) >= after_shards, timeout)
    if not was_killed(code):
        raise CacheError(f"the command ended (exit {code}) before {after_shards} "
                         f"shards existed; ask for fewer shards or a larger cache")
    try:
        return len(read_cache_manifest(folder)["shards"])
    except CacheError:
        return 0


def flip_a_byte(cache_dir: str | Path, shard: int = 1) -> str:
    """Damage a cache on purpose: invert one byte in the middle of a listed shard; its file name."""
    path = Path(cache_dir) / read_cache_manifest(cache_dir)["shards"][shard]["file"]
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    return path.name
