"""Notebook 03's demos and measurements: offload modes compared, a live kill, the outputs, the full run.

What the notebook shows about `nblib.encode` lives here, not in the core package: both offload
modes timed on the same cache, a CLI encode SIGKILLed mid-run (the resume is the CLI itself), a
PCA of the sketches, how often checksum codes collide, and the full seed_t4 run's disks per choice of
outputs, judged by the budget's one rule (its T4 time is `nblib.lab.simulated_t4.full_run_time`).
"""
from __future__ import annotations

import collections
import functools
import hashlib
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nblib import budget
from nblib.budget.resources import fits, margin_words
from nblib.compare import MIN_REPEATS, Spread, compare, interleaved
from nblib.config import OUTPUT_CHOICES, PipelineConfig, preset
from nblib.encode import OFFLOAD_MODES, PARTS_FOLDER, encode, open_store, read_run_manifest
from nblib.encode.protocols import ImageSource
from nblib.errors import StateError
from nblib.units import fmt_rate
from nblib.verdict import verdict_of_pairs

# ------------------------------------------------------------------------------ offload modes


def compare_offload(cache: ImageSource, config: PipelineConfig, folder: str | Path, device: str | None = None,
                    modes: tuple[str, ...] = OFFLOAD_MODES, repeats: int = MIN_REPEATS,
                    progress: bool = True) -> dict[str, Spread]:
    """Encode the same cache with each offload mode, `repeats` interleaved rounds: mode -> Spread of samples/s."""
    def run(mode: str) -> float:
        run_dir = Path(folder) / mode
        shutil.rmtree(run_dir, ignore_errors=True)
        return encode(cache, run_dir, config, device, offload=mode, progress=False, preflight=False,
                      do_consolidate=False).samples_per_s

    return interleaved({mode: functools.partial(run, mode) for mode in modes}, repeats,
                       progress="offload modes" if progress else False)


def offload_verdict(rates: dict[str, Spread], on_gpu: bool) -> str:
    """Which offload mode is faster here: the rounds' runs judged as pairs (`compare`), firm only beyond the noise."""
    (a, sa), (b, sb) = list(rates.items())[:2]
    v = compare(sa, sb, (a, b))
    where = "on this GPU" if on_gpu else "on this CPU (both modes are a memory copy here)"
    return f"{v.text('faster', 'slower')} {where}"


def rate_drift(timeline) -> str:
    """Section 3's prediction, judged: does the per-batch rate drift over the run? An EncodeReport's timeline,
    the first batch left out (warm-up); batch i of the earlier half paired with batch i of the later half
    (`verdict_of_pairs`, firm only beyond its minimum effect).
    """
    t, done = [0.0] + [p[0] for p in timeline], [0] + [p[1] for p in timeline]
    rates = [(done[i + 1] - done[i]) / max(t[i + 1] - t[i], 1e-9) for i in range(len(timeline))][1:]
    half = len(rates) // 2
    if half < MIN_REPEATS:
        return (f"{len(timeline)} batches: too few to judge whether the rate stays flat "
                f"(a call needs {MIN_REPEATS} pairs)")
    v = verdict_of_pairs(rates[:half], rates[half:2 * half], ("the earlier half", "the later half"))
    said = f"per-batch samples/s, {v.text('higher', 'lower')}"
    if v.direction == "lower":
        return f"the rate falls over the run: {said}"
    if v.direction == "higher":
        return f"the rate rises over the run (a warm-up longer than one batch): {said}"
    if v.within_effect:
        return f"no drift beyond x{v.min_effect:.2f} either way, as predicted: {said}"
    return f"cannot tell whether the rate drifts: the flat-rate prediction is neither confirmed nor refuted: {said}"


def rate_check(prediction, measured_samples_per_s: float) -> str:
    """The budget's projected samples/s beside the rate just measured, with how the projection was made.

    On a T4 the projection is nblib.t4_speed's sourced range (the ratio is against its mid); on a CPU it
    is a FLOP roofline at the preset's assumed share of peak, not a calibrated figure: the line says so
    and prints the measured/projected ratio, so the two numbers never stand apart.
    """
    dev = prediction.device
    ratio = measured_samples_per_s / prediction.samples_per_s if prediction.samples_per_s else float("nan")
    note = ("" if dev.is_gpu else "; a CPU's share of its peak for small kernels under load is far below the "
            "preset's, so trust the measured rate here and the budget's time only on a calibrated device")
    return (f"rate: the budget projected {prediction.rate_text()} ({prediction.speed_method}); measured "
            f"{fmt_rate(measured_samples_per_s)}, x{ratio:.3f} the projection"
            f"{' (its mid)' if prediction.speed else ''}{note}")


# ------------------------------------------------------------------------------ kill and resume


def encode_command(cache_dir: str | Path, out: str | Path, **flags) -> list[str]:
    """The `python -m nblib encode` command line: encode_command(c, o, batch_size=8, no_progress=True)."""
    from nblib.proc import cli_command

    return cli_command("encode", cache=cache_dir, out=out, **flags)


def run_and_kill(command: list[str], run_dir: str | Path, after_parts: int, timeout: float = 300.0) -> int:
    """Run an encode command, SIGKILL it (and its loader workers) once `after_parts` parts exist.

    Returns the samples the manifest listed as durable at the kill; raises StateError if the
    command ended on its own first (ask for fewer parts or a larger cache).
    """
    from nblib.proc import run_until, was_killed

    parts = Path(run_dir) / PARTS_FOLDER
    code = run_until(command, lambda: len(list(parts.glob("part-*/part.json"))) >= after_parts, timeout)
    if not was_killed(code):
        raise StateError(f"the command ended (exit {code}) before {after_parts} parts "
                         f"existed; ask for fewer parts or a larger cache (run it by hand to see why)")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        store = open_store(run_dir)
        try:
            manifest = read_run_manifest(store)
        finally:
            store.close()
    return 0 if manifest is None else manifest["samples_done"]


def resume(command: list[str], run_dir: str | Path, n_parts: int, progress: bool = True):
    """Run `command` (the killed encode) again to its end: its CompletedProcess, the suite's bar over the
    run's `n_parts` parts on disk while it runs (`DurableProgress`, the bar of a launch's rank 0).
    """
    import contextlib
    import subprocess

    from nblib.encode.layout import part_name
    from nblib.encode.ranks import DurableProgress

    names = [part_name(k) for k in range(n_parts)]
    with DurableProgress(Path(run_dir) / PARTS_FOLDER, names, "resume") if progress else contextlib.nullcontext():
        return subprocess.run(command, capture_output=True, text=True)


# ------------------------------------------------------------------------------ a look at the outputs


def sketch_projection(sketches: np.ndarray, max_samples: int = 4096) -> tuple[np.ndarray, np.ndarray]:
    """PCA of every (sample, capsule) sketch to 2-D via numpy SVD: (coords [n, capsules, 2], explained ratio [2])."""
    x = np.asarray(sketches[:max_samples], dtype=np.float64)
    n, c, d = x.shape
    flat = x.reshape(n * c, d)
    flat = flat - flat.mean(axis=0)
    _, s, vt = np.linalg.svd(flat, full_matrices=False)
    explained = (s**2 / max((s**2).sum(), 1e-300))[:2]
    return (flat @ vt[:2].T).reshape(n, c, 2), explained


@dataclass(frozen=True)
class ChecksumCollisions:
    """How often distinct images share a checksum code (the sign bits of their checksums)."""

    n_samples: int
    bits: int
    distinct_codes: int
    colliding_samples: int        # samples whose code another sample also has
    duplicate_images: int         # of those, samples whose image another sample also has
    hamming: np.ndarray           # pairwise Hamming distances of the codes (upper triangle)

    def __str__(self) -> str:
        closest = int(self.hamming[self.hamming > 0].min(initial=self.bits))
        return (f"{self.n_samples:,} samples, {self.bits}-bit codes: {self.distinct_codes:,} distinct, "
                f"{self.colliding_samples} samples share a code "
                f"({self.duplicate_images} of them are identical images); "
                f"the closest distinct codes differ in {closest} bit(s)")


def image_hashes(cache: ImageSource, n: int | None = None, batch: int = 256) -> list[str]:
    """sha256 of each of the first n images of a cache: equal hashes are identical images."""
    n = len(cache) if n is None else min(n, len(cache))
    return [hashlib.sha256(image.tobytes()).hexdigest()
            for start in range(0, n, batch) for image in cache.get_batch(start, min(start + batch, n))]


def checksum_collisions(checksums: np.ndarray, image_hashes: list[str] | None = None,
                        max_samples: int = 2048) -> ChecksumCollisions:
    """Codes of the checksums (one bit per value: above its median over the samples or not),
    their collisions and pairwise Hamming distances.

    Thresholding at the median, not at 0, makes every bit split the samples in half: images
    share much of their look (white page, dark glyphs), so raw signs would be nearly constant.
    With `image_hashes` (see `image_hashes(cache)`), collisions of identical images are counted
    apart: those are the checksum doing its job, not a collision of distinct images.
    """
    x = np.asarray(checksums[:max_samples], dtype=np.float32).reshape(min(len(checksums), max_samples), -1)
    codes = x > np.median(x, axis=0)
    packed = [c.tobytes() for c in np.packbits(codes, axis=1)]
    counts = collections.Counter(packed)
    colliding = [i for i, code in enumerate(packed) if counts[code] > 1]
    duplicates = 0
    if image_hashes is not None:
        seen = collections.Counter(image_hashes[:len(x)])
        duplicates = sum(1 for i in colliding if seen[image_hashes[i]] > 1)
    c = codes.astype(np.float32)  # float matmul: exact for counts below 2**24, and fast
    distances = np.rint(c.shape[1] - (c @ c.T + (1 - c) @ (1 - c).T)).astype(np.int32)
    upper = distances[np.triu_indices(len(x), k=1)]
    return ChecksumCollisions(n_samples=len(x), bits=codes.shape[1], distinct_codes=len(counts),
                              colliding_samples=len(colliding), duplicate_images=duplicates,
                              hamming=upper)


# ------------------------------------------------------------------------------ the full run


DRIVE_PLANS_GB = {"Drive free tier": 15, "Drive 200 GB plan": 200}   # the Drives the full run is held against


@dataclass(frozen=True)
class DiskChoice:
    """One choice of outputs and dtype for the full run: what the budget puts on each disk, and where it fits.

    The run's local disk holds the parts and the consolidated copy (the budget's "local disk" total); a
    Drive holds the mirrored parts (the budget's "mirrored parts" line; the image cache is sized apart).
    """

    label: str
    outputs_bytes: int              # one copy of the outputs: the parts
    needs: dict[str, float]         # disk -> bytes the budget puts there
    limits: dict[str, float]        # disk -> its size

    @property
    def fitting(self) -> tuple[str, ...]:
        """The disks it fits by the one rule (`nblib.budget.resources.fits`: within 90% of each)."""
        return tuple(disk for disk, need in self.needs.items() if fits(need, self.limits[disk]))


def full_run_disk(target: PipelineConfig | None = None, device: str = "t4",
                  drive_plans_gb: dict[str, float] = DRIVE_PLANS_GB) -> tuple[DiskChoice, ...]:
    """The full run's disks per choice of outputs (every output in float32, then each of
    `nblib.config.OUTPUT_CHOICES` in float16), each from the budget of that choice on `device`.
    """
    target = target or preset("seed_t4")
    choices = []
    for outs in OUTPUT_CHOICES:
        for dtype in ("float32", "float16") if len(outs) == 3 else ("float16",):
            b = budget.predict_budget(target.replace(outputs=outs, out_dtype=dtype), device)
            mirrored = {line.name: line.bytes for line in b.lines["drive"]}["mirrored parts"]
            local = f"{device} local disk"
            choices.append(DiskChoice(f"{'+'.join(outs)} {dtype}", mirrored,
                                      {local: b.totals["local disk"], **{name: mirrored for name in drive_plans_gb}},
                                      {local: b.limits["local disk"],
                                       **{name: gb * 1e9 for name, gb in drive_plans_gb.items()}}))
    return tuple(choices)


def disk_table(choices: tuple[DiskChoice, ...]) -> str:
    """Each choice: its outputs, what each disk must hold (of its size), and the verdict of the one rule."""
    disks = list(choices[0].needs)
    rows = ["full run, per choice of outputs: what each disk holds (the local disk: the parts and the consolidated "
            "copy; a Drive: the mirrored parts, the image cache apart), GB of its size; * fits " + margin_words(),
            f"  {'outputs':<36} {'parts':>8}" + "".join(f"  {d:>22}" for d in disks)]
    for c in choices:
        rows.append(f"  {c.label:<36} {c.outputs_bytes / 1e9:>8,.1f}" + "".join(
            f"  {f'{c.needs[d] / 1e9:,.1f} of {c.limits[d] / 1e9:,.0f}' + ('*' if d in c.fitting else ' '):>22}"
            for d in disks))
    return "\n".join(rows)


def disk_verdict(choices: tuple[DiskChoice, ...]) -> str:
    """Which choices fit every disk, computed from the choices' budgets (never typed)."""
    every = [c.label for c in choices if len(c.fitting) == len(c.needs)]
    some = [c.label for c in choices if c.fitting and len(c.fitting) < len(c.needs)]
    return (f"fit every disk: {', '.join(every) or 'none'}; fit some: {', '.join(some) or 'none'}; "
            f"fit none: {', '.join(c.label for c in choices if not c.fitting) or 'none'}")
