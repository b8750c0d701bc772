"""Notebook 02's measurements and demos: render scaling by workers, read throughput, kill-and-resume.

The cache itself (format, populate, verify, reader) is `nblib.cache`; this module only measures it
and stages the live SIGKILL demo with a real `python -m nblib cache` process (`nblib.proc`).
"""
from __future__ import annotations

import functools
import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nblib.cache import ShardedImageCache, populate, read_cache_manifest
from nblib.compare import MIN_REPEATS, Spread, compare, interleaved, interleaved_order
from nblib.env import usable_cores
from nblib.errors import CacheError
from nblib.lab.input_pipeline import encoder_projection  # noqa: F401  the encoder's rate a read must beat (notebook 02)
from nblib.units import fmt_duration
from nblib.verdict import verdict_of_runs


def texts_sharing_an_image(texts: Sequence[str], image_size: int) -> list[list[str]]:
    """Groups of distinct texts whose rendered images are byte-identical (what the encoder cannot tell apart)."""
    import hashlib

    from nblib.render import render_text

    by_image: dict[str, list[str]] = {}
    for text in dict.fromkeys(texts):
        digest = hashlib.sha256(render_text(text, image_size).tobytes()).hexdigest()
        by_image.setdefault(digest, []).append(text)
    return [group for group in by_image.values() if len(group) > 1]


# render scaling: a run shorter than this mostly times the pool's start-up, not rendering
MIN_RUN_SECONDS = 1.0
SCALES_SHARE = 0.5     # "scales": the speed-up with w workers is at least half of linear (w x)


@dataclass(frozen=True)
class Scaling:
    """Images/s per worker count (repeated, interleaved), the work per run, and the machine's load."""

    rates: dict[int, Spread]
    n_texts: int
    cores: int
    load: float                 # the 1-minute load average while measuring

    @property
    def verdict(self) -> str:
        return scaling_verdict(self.rates, self.n_texts, self.cores, self.load)

    def table(self) -> str:
        """Each worker count's runs, and its speed-up over one worker as its paired verdict prints it."""
        fewest = min(self.rates)
        one = self.rates[fewest]
        lines = [f"{self.n_texts:,} texts per run, {one.n} interleaved rounds; {self.cores} cores, load average "
                 f"{self.load:.1f}; speed-up: the paired verdict against {fewest} worker(s)"]
        for workers, rate in self.rates.items():
            speed_up = "" if workers == fewest else f"  speed-up {compare(one, rate).head}"
            lines.append(f"  {workers} worker(s): {rate.text(unit='images/s')}{speed_up}")
        return "\n".join(lines)


def worker_scaling(texts, worker_counts: Sequence[int], folder: str | Path, image_size: int = 224,
                   shard_mb: float = 400, codec: str = "raw", repeats: int = MIN_REPEATS,
                   progress: bool = True, budget_s: float | None = None) -> Scaling:
    """Populate the same texts per worker count, `repeats` interleaved rounds; images/s of each.

    With `budget_s`, more rounds run while the fewest against the most workers is undecided (`interleaved`).
    """
    texts = list(texts)

    def run(workers: int) -> float:
        target = Path(folder) / f"workers-{workers}"
        shutil.rmtree(target, ignore_errors=True)
        try:
            return populate(texts, target, image_size, shard_mb, workers=workers, codec=codec,
                            progress=False).images_per_s
        finally:
            shutil.rmtree(target, ignore_errors=True)

    rates = interleaved({w: functools.partial(run, w) for w in worker_counts}, repeats,
                        progress="render scaling" if progress else False, budget_s=budget_s,
                        decide=((min(worker_counts), max(worker_counts)),))
    return Scaling(rates=rates, n_texts=len(texts), cores=usable_cores(), load=os.getloadavg()[0])


def scaling_verdict(rates: dict[int, Spread], n_texts: int, cores: int, load: float) -> str:
    """Does rendering scale with workers here? Computed from the rounds' pairs (`compare`), never assumed.

    "cannot show it" when one worker's run is shorter than MIN_RUN_SECONDS (pool start-up dominates);
    "no scaling shown" when the paired verdict of the most workers against one is not firm; "scales" when
    it is faster by at least SCALES_SHARE of linear, "scales weakly" when faster by less, and "slower"
    when the most workers are slower.
    """
    one, most = min(rates), max(rates)
    if one == most:
        return "one worker count only: nothing to compare"
    seconds = n_texts / rates[one].median if rates[one].median > 0 else float("inf")
    if seconds < MIN_RUN_SECONDS:
        return (f"this profile cannot show scaling: one worker renders the {n_texts:,} texts in "
                f"{fmt_duration(seconds)}, so a run mostly times the pool's start-up (raise the texts per run)")
    v = compare(rates[one], rates[most], (f"{one} worker", f"{most} workers"))
    busy, said = f"{cores} cores, load average {load:.1f}", v.text("faster", "slower")
    if not v.distinguishable:
        return f"rendering speed-up {said}: no scaling shown ({busy})"
    if v.ratio >= 1 + SCALES_SHARE * (most / one - 1):
        return f"rendering scales: {said} ({busy})"
    if v.ratio > 1:
        return f"rendering scales weakly: {said}, under half of linear ({busy}: few free cores)"
    return f"more workers are slower here: {said} (pool overhead on busy cores; {busy})"


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


def read_throughput_runs(caches: dict, repeats: int = MIN_REPEATS) -> dict[str, Spread]:
    """`read_throughput` of each cache, `repeats` interleaved rounds: "<cache>: <pattern>" -> Spread of images/s."""
    got: dict[str, list[float]] = {}
    for name in interleaved_order(list(caches), repeats):
        for pattern, rate in read_throughput(caches[name]).items():
            got.setdefault(f"{name}: {pattern}", []).append(rate)
    return {key: Spread(tuple(values)) for key, values in got.items()}


def read_verdict(rates: dict[str, Spread], encoder_samples_per_s: float, encoder_method: str,
                 image_size: int = 224, encoder_image_size: int = 224) -> str:
    """Does every read pattern feed the encoder? Each pattern's runs against the encoder's rate (`verdict_of_runs`):
    only when every pattern's whole interval is faster by the minimum effect or more, at the same image
    size: a cache of smaller images than the encoder's cannot answer it (like for like).
    """
    where = f"the encoder's {encoder_samples_per_s:,.0f} images/s at {encoder_image_size} px ({encoder_method})"
    if image_size != encoder_image_size:
        fewer = encoder_image_size ** 2 / image_size ** 2
        return (f"this profile cannot show it: the encoder's rate is for {encoder_image_size} px images, and this "
                f"cache holds {image_size} px ones, {fewer:,.0f}x fewer bytes each; run the t4 profile. (The rate: "
                f"{where}.)")
    verdicts = {name: verdict_of_runs(s.values, encoder_samples_per_s, ("the encoder", name))
                for name, s in rates.items()}
    slow = {name: v for name, v in verdicts.items() if v.direction != "higher"}
    if not slow:
        worst = min(verdicts, key=lambda k: verdicts[k].low)
        return (f"every read pattern beats {where}; the one nearest it, {worst}, reads "
                f"{verdicts[worst].short('faster', 'slower')}")
    return "not every read pattern keeps up with " + where + ": " + "; ".join(
        f"{name} {v.short('faster', 'slower')}" for name, v in slow.items())


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
