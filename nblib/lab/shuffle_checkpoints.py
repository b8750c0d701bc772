"""Notebook 04's experiment: tf.data shuffle checkpoints measured, fitted, set against the reference.

Sweeps real tf.data iterator checkpoints over buffer sizes (nblib.tfdata's primitives), fits
bytes = fixed + buffer x bytes per element, extrapolates the reference's checkpoint table
(nblib.reference.CHECKPOINT_TABLE), and compares the measured peak disk with nblib.budget's
model (`checkpoint_disk_peak`) and with the reference's claim; every verdict is computed from a
tolerance. Also: which tf.data ops keep a checkpoint small, the resumable shuffles' JSON state,
an exact-resume proof, TensorFlow's own buffer-free shuffles (index_shuffle, the private global
shuffle) measured beside Dataset.shuffle and nblib's in one table, shuffle quality against buffer
size, and throughput.
"""
from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from nblib import budget
from nblib.errors import ConfigError
from nblib.reference import CHECKPOINT_TABLE, COLAB
from nblib.tfdata import (
    GLOBAL_SHUFFLE_SINCE,
    SHUFFLE_METHODS,
    TF_GLOBAL_SHUFFLE,
    TF_SHUFFLE,
    CheckpointRow,
    PipelineSpec,
    folder_bytes,
    global_shuffle_op,
    index_dataset,
    make_shuffle,
    measure_iterator_checkpoint,
    preflight_checkpoint,
    reference_pipeline,
    resumable_shuffle_pipeline,
    same_element,
    sample_at,
    shuffle_pipeline,
    source_dataset,
    tensorflow,
    tf_shuffle_order,
)
from nblib.units import GB, MB, GiB, fmt_bytes

TOLERANCE = 0.10
REFERENCE_BUFFERS = CHECKPOINT_TABLE["shuffle buffers"].value
REFERENCE_SAMPLE_BYTES = CHECKPOINT_TABLE["sample size"].value
REFERENCE_TEMP_FACTOR = CHECKPOINT_TABLE["temporary space during a save"].value


def resumable_label(algorithm: str) -> str:
    """The name rows carry for nblib's shuffle `algorithm` ("buffer" or "global")."""
    return f"resumable ({algorithm})"


# ------------------------------------------------------------------------ checkpoint sweeps


def measure_checkpoint(buffer_sizes, sample_kb: float, *, symbolic=(False, True), folder=None,
                       seed: int = 0, batch_size: int = 8, prefetch: int = 2, sources: int = 1,
                       content: str = "random", resumable: str | None = None,
                       steps: int = 3) -> list[CheckpointRow]:
    """Save and restore a real tf.data iterator per buffer size and symbolic flag; measure each.

    `resumable=None` measures tf.data's own shuffle; `resumable="buffer"|"global"` measures
    `tfdata.resumable_shuffle_pipeline` instead (always symbolic). Each checkpoint is deleted
    once measured; before the first one a preflight refuses buffers that would not fit.
    """
    buffer_sizes = [int(b) for b in buffer_sizes]
    symbolic = (True,) if resumable else tuple(symbolic)
    base = PipelineSpec(sample_kb=sample_kb, seed=seed, batch_size=batch_size, prefetch=prefetch,
                        sources=sources, content=content)
    root = Path(folder) if folder is not None else Path(tempfile.mkdtemp(prefix="nblib-tfckpt-"))
    root.mkdir(parents=True, exist_ok=True)
    if not resumable:
        preflight_checkpoint(max(buffer_sizes), base.sample_bytes, root)
    label = resumable_label(resumable) if resumable else TF_SHUFFLE
    rows = []
    for buffer_size in buffer_sizes:
        for flag in symbolic:
            spec = replace(base, buffer_size=buffer_size, symbolic=flag,
                           n_samples=buffer_size + (steps + 2 + prefetch) * max(1, batch_size) + 8)
            if resumable:
                build = lambda s=spec: resumable_shuffle_pipeline(s, resumable)  # noqa: E731
            else:
                build = lambda s=spec: reference_pipeline(s)  # noqa: E731
            where = root / f"{label[:4]}-b{buffer_size}-s{int(flag)}"
            rows.append(measure_iterator_checkpoint(label, spec, build, where, steps))
    if folder is None:
        shutil.rmtree(root, ignore_errors=True)
    return rows


def checkpoint_table(rows) -> str:
    """Measured checkpoint rows as a text table (bytes, seconds, peaks, exact resume)."""
    lines = [f"{'pipeline':<18} {'buffer':>7} {'symbolic':>8} {'on disk':>10} {'x buffer':>8} {'save s':>7} "
             f"{'restore s':>9} {'peak disk':>10} {'prev. kept':>10} {'save +RAM':>10} {'exact':>5}"]
    for r in rows:
        if r.error:
            lines.append(f"{r.pipeline:<18} {r.buffer_size:>7,} {str(r.symbolic):>8}  refused: {r.error}")
            continue
        lines.append(f"{r.pipeline:<18} {r.buffer_size:>7,} {str(r.symbolic):>8} {_b(r.bytes_on_disk):>10} "
                     f"{r.bytes_on_disk / r.buffer_bytes:>8.3f} {r.save_s:>7.3f} {r.restore_s:>9.3f} "
                     f"{_b(r.peak_disk_bytes):>10} {_b(r.peak_disk_rotating_bytes):>10} "
                     f"{_b(r.save_extra_rss_bytes):>10} {str(r.exact_resume):>5}")
    return "\n".join(lines)


def symbolic_saving(rows) -> dict[int, float]:
    """Per buffer: the share of a plain tf.data checkpoint's bytes that symbolic checkpointing saves."""
    plain = {r.buffer_size: r.bytes_on_disk for r in _tf_rows(rows) if not r.symbolic}
    symbolic = {r.buffer_size: r.bytes_on_disk for r in _tf_rows(rows) if r.symbolic}
    return {b: 1 - symbolic[b] / plain[b] for b in sorted(plain) if b in symbolic}


def compression_ratio(random_row: CheckpointRow, constant_row: CheckpointRow) -> float:
    """How many times smaller the checkpoint of constant images is than that of random ones."""
    return random_row.bytes_on_disk / constant_row.bytes_on_disk


# ----------------------------------------------------------- fit, extrapolation, the checks


@dataclass(frozen=True)
class BytesFit:
    """checkpoint bytes = fixed_bytes + buffer x (sample_bytes + overhead_per_element), fitted."""

    bytes_per_element: float       # the slope, at the measured sample size
    fixed_bytes: float             # the intercept: graph state, prefetched batches, index file
    sample_bytes: int
    symbolic: bool

    @property
    def overhead_per_element(self) -> float:
        """Bytes written per buffered element beyond its pixels (tensor headers, framing)."""
        return self.bytes_per_element - self.sample_bytes

    def predict(self, buffer_size: int, sample_bytes: int | None = None) -> float:
        """Predicted checkpoint bytes for a buffer of `buffer_size` samples of `sample_bytes`."""
        per = self.bytes_per_element if sample_bytes is None else sample_bytes + self.overhead_per_element
        return self.fixed_bytes + buffer_size * per


def fit_bytes_per_element(rows, symbolic: bool = False) -> BytesFit:
    """Least-squares line through (buffer, bytes on disk) of tf.data rows with this symbolic flag."""
    points = [(r.buffer_size, r.bytes_on_disk) for r in _tf_rows(rows) if r.symbolic == symbolic]
    if len({b for b, _ in points}) < 2:
        raise ConfigError(f"fitting needs rows of >= 2 distinct buffer sizes with symbolic={symbolic}; "
                          f"got {sorted({b for b, _ in points})}: measure more buffer_sizes")
    slope, intercept = np.polyfit(*zip(*points), 1)
    sample_bytes = next(r.sample_bytes for r in rows if r.symbolic == symbolic)
    return BytesFit(float(slope), float(intercept), int(sample_bytes), symbolic)


@dataclass(frozen=True)
class ExtrapolationRow:
    """One row of the reference table beside what the fit and the budget's model predict for it."""

    buffer_size: int
    sample_bytes: int
    reference_bytes: float             # buffer x ~500 KB, as the reference computes it
    reference_peak_bytes: tuple[float, float]  # the reference's temporary-space range x that
    predicted_bytes: float             # from the fit (per-element overhead included)
    predicted_first_save_peak: float   # budget.checkpoint_disk_peak(keep_previous=False)
    predicted_rotating_peak: float     # budget.checkpoint_disk_peak(keep_previous=True)
    buffer_ram_bytes: float            # the buffer itself, held in RAM before any save
    restore_ram_bytes: float           # extra RAM while restoring (measured factor)


def extrapolate(fit: BytesFit, rows, buffers=REFERENCE_BUFFERS,
                sample_bytes: int = REFERENCE_SAMPLE_BYTES) -> list[ExtrapolationRow]:
    """Predict the reference rows from the fit, the budget's disk model and the measured RAM factor."""
    restore_factor = measured_factors(rows)["restore_ram_factor"]
    out = []
    for b in buffers:
        predicted = fit.predict(b, sample_bytes)
        reference = b * REFERENCE_SAMPLE_BYTES
        out.append(ExtrapolationRow(
            b, sample_bytes, reference, tuple(f * reference for f in REFERENCE_TEMP_FACTOR), predicted,
            budget.checkpoint_disk_peak(round(predicted), keep_previous=False),
            budget.checkpoint_disk_peak(round(predicted), keep_previous=True),
            float(b * sample_bytes), b * sample_bytes * restore_factor))
    return out


def extrapolation_table(extrapolation) -> str:
    """The reference rows beside the prediction, in GB and GiB."""
    lo_f, hi_f = REFERENCE_TEMP_FACTOR
    lines = [f"{'buffer':>8} | {'reference':>9} {f'ref. peak {lo_f:g}-{hi_f:g}x':>16} | {'fit':>12} {'(GiB)':>7} "
             f"{'1st-save peak':>13} {'prev. kept':>13} {'buffer in RAM':>13}"]
    for e in extrapolation:
        lo, hi = (x / GB for x in e.reference_peak_bytes)
        lines.append(f"{e.buffer_size:>8,} | {e.reference_bytes / GB:>6.0f} GB {lo:>7.1f}-{hi:>5.0f} GB | "
                     f"{e.predicted_bytes / GB:>9.1f} GB {e.predicted_bytes / GiB:>7.1f} "
                     f"{e.predicted_first_save_peak / GB:>10.1f} GB {e.predicted_rotating_peak / GB:>10.1f} GB "
                     f"{e.buffer_ram_bytes / GB:>10.1f} GB")
    return "\n".join(lines)


def measured_factors(rows) -> dict[str, float]:
    """Peak-disk and RAM factors of the largest measured tf.data buffer (worst over its rows)."""
    good = [r for r in _tf_rows(rows) if r.bytes_on_disk]
    if not good:
        raise ConfigError("no successful tf.data checkpoint rows to take factors from; measure some first")
    largest = max(r.buffer_size for r in good)
    top = [r for r in good if r.buffer_size == largest]
    return {
        "temp_factor": max(r.temp_factor for r in top),
        "rotating_factor": max(r.rotating_factor for r in top),
        "save_ram_factor": max(r.save_extra_rss_bytes / r.buffer_bytes for r in top),
        "save_extra_ram_bytes": float(max(r.save_extra_rss_bytes for r in top)),
        "restore_ram_factor": max(r.restore_extra_rss_bytes / r.buffer_bytes for r in top),
    }


@dataclass(frozen=True)
class Check:
    """An expected figure (the reference's or the budget model's) beside what was measured."""

    claim: str
    source: str                          # "reference" or "budget model"
    expected: float | tuple[float, float]  # a value, or a (low, high) range
    measured: float
    unit: str                            # "x checkpoint" or "B"
    tolerance: float = TOLERANCE

    @property
    def right(self) -> bool:
        """The measurement lies within `tolerance` of the value (or of the range's ends)."""
        low, high = self.expected if isinstance(self.expected, tuple) else (self.expected, self.expected)
        return low * (1 - self.tolerance) <= self.measured <= high * (1 + self.tolerance)

    @property
    def verdict(self) -> str:
        return "right" if self.right else "wrong"


def disk_model_checks(rows, tolerance: float = TOLERANCE) -> list[Check]:
    """budget.checkpoint_disk_peak against the measured peak disk of the largest tf.data buffer."""
    f = measured_factors(rows)
    return [Check(f"peak disk, {what}", "budget model", budget.checkpoint_disk_peak(1, keep_previous=kept),
                  f[key], "x checkpoint", tolerance)
            for what, kept, key in (("first save", False, "temp_factor"),
                                    ("previous checkpoint kept", True, "rotating_factor"))]


def reference_checks(fit: BytesFit, rows, tolerance: float = TOLERANCE) -> list[Check]:
    """The reference's checkpoint size and temporary-space claim against the fit and the measurements."""
    f = measured_factors(rows)
    b = 250_000
    return [
        Check(f"checkpoint of {b:,} x {REFERENCE_SAMPLE_BYTES / 1e3:.0f} kB", "reference",
              b * REFERENCE_SAMPLE_BYTES, fit.predict(b, REFERENCE_SAMPLE_BYTES), "B", tolerance),
        Check("peak disk, first save", "reference", REFERENCE_TEMP_FACTOR, f["temp_factor"], "x checkpoint",
              tolerance),
        Check("peak disk, previous checkpoint kept", "reference", REFERENCE_TEMP_FACTOR, f["rotating_factor"],
              "x checkpoint", tolerance),
    ]


def checks_table(checks: list[Check]) -> str:
    """Checks as text: claim, source, expected, measured, verdict (tolerance in the header)."""
    def show(value, unit):
        if isinstance(value, tuple):
            return "-".join(f"{v:g}" for v in value) + "x"
        return _b(value) if unit == "B" else f"{value:.2f}x"

    tol = checks[0].tolerance if checks else TOLERANCE
    lines = [f"{'claim':<36} {'source':<13} {'expected':>10} {'measured':>10}  verdict (within {tol:.0%})"]
    lines += [f"{c.claim:<36} {c.source:<13} {show(c.expected, c.unit):>10} {show(c.measured, c.unit):>10}  "
              f"{c.verdict}" for c in checks]
    return "\n".join(lines)


def ram_note(rows, buffer_size: int = 250_000, sample_bytes: int = REFERENCE_SAMPLE_BYTES,
             ram_bytes: float = COLAB["RAM"].value) -> str:
    """The RAM a reference-sized buffer holds, against Colab's RAM, and what save and restore add."""
    f = measured_factors(rows)
    held = buffer_size * sample_bytes
    return (f"a {buffer_size:,} x {sample_bytes / 1e3:.0f} kB shuffle buffer holds {held / GB:.0f} GB in RAM "
            f"before any save, {held / ram_bytes:.1f}x Colab's {ram_bytes / GB:.1f} GB; measured, a save adds "
            f"{f['save_extra_ram_bytes'] / MB:.0f} MB and a restore {f['restore_ram_factor']:.2f}x the buffer")


# ------------------------------------------------------------------------ which ops are small


@dataclass(frozen=True)
class OpRow:
    """What one small pipeline's iterator checkpoint writes, plain or symbolic."""

    pipeline: str
    symbolic: bool
    bytes_on_disk: int             # 0 when TensorFlow refused to save
    error: str = ""


def measure_ops(sample_kb: float = 16.0, *, n: int = 256, seed: int = 0, folder=None) -> list[OpRow]:
    """Checkpoint bytes of one-op pipelines after 5 elements: which ops keep a checkpoint small."""
    tf = tensorflow()
    spec = PipelineSpec(n_samples=n, sample_kb=sample_kb, seed=seed)
    fetch = sample_at(spec)
    order = np.random.default_rng(seed).permutation(n)
    pipelines = {
        "range -> map": lambda: tf.data.Dataset.range(n).map(fetch),
        "range -> map(parallel=4)": lambda: tf.data.Dataset.range(n).map(fetch, num_parallel_calls=4),
        "range -> map -> batch(8)": lambda: tf.data.Dataset.range(n).map(fetch).batch(8),
        "range -> map -> prefetch(8)": lambda: tf.data.Dataset.range(n).map(fetch).prefetch(8),
        "interleave(4 sources)": lambda: source_dataset(replace(spec, sources=4)),
        "from_tensor_slices(order) -> map": lambda: tf.data.Dataset.from_tensor_slices(order).map(fetch),
        "range -> map(numpy_function)": lambda: tf.data.Dataset.range(n).map(
            lambda i: tf.numpy_function(lambda x: x, [i], tf.int64)),
        "range -> map -> shuffle(32)": lambda: tf.data.Dataset.range(n).map(fetch).shuffle(32, seed=seed),
    }
    root = Path(folder) if folder is not None else Path(tempfile.mkdtemp(prefix="nblib-ops-"))
    rows = []
    for name, build in pipelines.items():
        for symbolic in (False, True):
            options = tf.data.Options()
            options.experimental_symbolic_checkpoint = symbolic
            iterator = iter(build().with_options(options))
            for _ in range(5):
                next(iterator)
            target = root / f"op-{len(rows)}"
            try:
                tf.train.Checkpoint(iterator=iterator).write(str(target / "ckpt"))
                rows.append(OpRow(name, symbolic, folder_bytes(target)))
            except Exception as exc:  # e.g. "PyFunc is stateful": the answer, not a crash
                rows.append(OpRow(name, symbolic, 0, f"{type(exc).__name__}: {str(exc).splitlines()[0]}"[:160]))
            shutil.rmtree(target, ignore_errors=True)
    if folder is None:
        shutil.rmtree(root, ignore_errors=True)
    return rows


def ops_table(rows) -> str:
    """measure_ops rows as text: one line per pipeline, plain and symbolic side by side."""
    def cell(r):
        return "refused (PyFunc is stateful)" if r.error and "stateful" in r.error else (
            f"refused: {r.error[:40]}" if r.error else _b(r.bytes_on_disk))

    names = list(dict.fromkeys(r.pipeline for r in rows))
    lines = [f"{'pipeline (5 elements consumed)':<34} {'plain':>28} {'symbolic':>10}"]
    for name in names:
        plain = next(r for r in rows if r.pipeline == name and not r.symbolic)
        symbolic = next(r for r in rows if r.pipeline == name and r.symbolic)
        lines.append(f"{name:<34} {cell(plain):>28} {cell(symbolic):>10}")
    return "\n".join(lines)


# ------------------------------------------------------- the resumable shuffles' state file


@dataclass(frozen=True)
class StateRow:
    """A resumable shuffle's checkpoint: its JSON state file, whatever the sample size."""

    algorithm: str                 # "buffer" (ResumableShuffleBuffer) or "global" (GlobalShuffle)
    buffer_size: int
    n_samples: int
    state_bytes: int
    save_s: float                  # state_dict + JSON + atomic write (fsync, rename)
    restore_s: float               # read + load_state_dict into a fresh object
    exact_resume: bool             # the next index after restore == the uninterrupted next index

    @property
    def bound_bytes(self) -> int:
        """The promise: <= 8 bytes x buffer + 4 KB."""
        return 8 * self.buffer_size + 4096

    @property
    def within_bound(self) -> bool:
        return self.state_bytes <= self.bound_bytes


def measure_state_checkpoint(buffer_sizes, *, algorithm: str = "buffer", n_factor: int = 4, seed: int = 0,
                             folder=None) -> list[StateRow]:
    """Save and restore a resumable shuffle's JSON state mid-epoch (buffer full) for each buffer size."""
    from nblib import shuffle

    root = Path(folder) if folder is not None else Path(tempfile.mkdtemp(prefix="nblib-state-"))
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    for buffer_size in (int(b) for b in buffer_sizes):
        n = max(2, n_factor * buffer_size)
        shuffler = make_shuffle(n, buffer_size, seed, algorithm)
        iterator = iter(shuffler)
        for _ in range(n // 2):
            next(iterator)
        path = root / f"state-{algorithm}-{buffer_size}.json"
        t0 = time.perf_counter()
        shuffle.save_state(path, shuffler)
        save_s = time.perf_counter() - t0
        expected = next(iterator)
        fresh = make_shuffle(n, buffer_size, seed, algorithm)
        t0 = time.perf_counter()
        shuffle.load_state(path, fresh)
        restore_s = time.perf_counter() - t0
        rows.append(StateRow(algorithm, buffer_size, n, path.stat().st_size, save_s, restore_s,
                             next(iter(fresh)) == expected))
        path.unlink()
    if folder is None:
        shutil.rmtree(root, ignore_errors=True)
    return rows


def comparison_table(tf_rows, resumable_rows, state_rows) -> str:
    """Per buffer: tf.data (plain, symbolic) vs resumable (tf.data checkpoint, JSON state), bytes and seconds."""
    def pick(rows, b, **match):
        return next((r for r in rows if r.buffer_size == b and all(getattr(r, k) == v for k, v in match.items())),
                    None)

    lines = [f"{'buffer':>7} | {'tf.data':>9} {'symbolic':>9} {'resumable':>10} {'JSON':>9} {'sym/res.':>9} | "
             f"{'save s: tf.data':>15} {'resumable':>10} {'JSON':>9}"]
    for b in sorted({r.buffer_size for r in tf_rows}):
        plain, symbolic = pick(tf_rows, b, symbolic=False), pick(tf_rows, b, symbolic=True)
        resumable, state = pick(resumable_rows, b), pick(state_rows, b)
        if None in (plain, symbolic, resumable, state):
            continue
        lines.append(f"{b:>7,} | {_b(plain.bytes_on_disk):>9} {_b(symbolic.bytes_on_disk):>9} "
                     f"{_b(resumable.bytes_on_disk):>10} {_b(state.state_bytes):>9} "
                     f"{symbolic.bytes_on_disk / resumable.bytes_on_disk:>8,.0f}x | {plain.save_s:>15.3f} "
                     f"{resumable.save_s:>10.3f} {state.save_s:>9.3f}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- exact resume


@dataclass(frozen=True)
class ResumeProof:
    """A tf.train.Checkpoint round trip: cut, save, restore into a fresh pipeline, compare."""

    algorithm: str
    cut_after: int                 # elements consumed before the save
    compared: int                  # elements compared after the restore
    identical: bool                # every compared element (indices and pixels) is equal
    next_indices: tuple[int, ...]  # the first indices after the cut (restored run)
    checkpoint_bytes: int


def resume_proof(spec: PipelineSpec, folder, *, algorithm: str = "buffer", cut_after: int = 10,
                 compared: int = 50) -> ResumeProof:
    """Cut the resumable pipeline after `cut_after` elements, checkpoint, restore, compare `compared` more."""
    tf = tensorflow()
    folder = Path(folder)
    shutil.rmtree(folder, ignore_errors=True)
    iterator = iter(resumable_shuffle_pipeline(spec, algorithm))
    for _ in range(cut_after):
        next(iterator)
    path = tf.train.Checkpoint(iterator=iterator).write(str(folder / "ckpt"))
    expected = [e for _, e in zip(range(compared), iterator)]
    fresh = iter(resumable_shuffle_pipeline(spec, algorithm))
    tf.train.Checkpoint(iterator=fresh).read(path).assert_consumed()
    got = [e for _, e in zip(range(compared), fresh)]
    identical = len(got) == len(expected) and all(same_element(a, b) for a, b in zip(expected, got))
    first = np.asarray(got[0]["index"]).reshape(-1)[:8].tolist() if got else []
    return ResumeProof(algorithm, cut_after, len(got), identical, tuple(first), folder_bytes(folder))


# ------------------------------------------------------------- tf.data's own shuffles, beside ours


@dataclass(frozen=True)
class BuiltinRow:
    """One shuffle in the reference pipeline: checkpoint bytes, exact resume, throughput, what it needs."""

    method: str                    # a name of tfdata.SHUFFLE_METHODS
    buffer_size: int               # Dataset.shuffle's and ResumableShuffleBuffer's buffer (others: none)
    n_samples: int
    plain_bytes: int               # tf.train.Checkpoint of the iterator after `cut_after` batches
    symbolic_bytes: int            # the same with options.experimental_symbolic_checkpoint = True
    exact_plain: bool              # the next batches after a restore equal the uninterrupted run's
    exact_symbolic: bool
    samples_per_s: float           # one full pass over the pipeline (symbolic), samples and pixels
    same_order_in_numpy: bool | None  # TF's order == nblib.shuffle.full_order (None: no numpy twin)
    skipped: str = ""              # why the method was not measured (e.g. missing in this TensorFlow)

    @property
    def needs(self) -> str:
        """What the method needs, in words."""
        m = SHUFFLE_METHODS[self.method]
        needs = [("random access" + (" in every op before it" if self.method == TF_GLOBAL_SHUFFLE else ""))
                 if m.random_access else "any stream", "known size" if m.known_size else "",
                 f"TF >= {m.since_tf}" if m.since_tf != "any" else "", "" if m.public else "private API",
                 f"{self.buffer_size:,} samples in RAM" if self.method == TF_SHUFFLE else ""]
        return ", ".join(n for n in needs if n)


def compare_shuffles(spec: PipelineSpec, folder, *, cut_after: int = 5, compared: int = 20,
                     methods=tuple(SHUFFLE_METHODS)) -> list[BuiltinRow]:
    """Every shuffle method on the same pipeline: checkpoint bytes (plain, symbolic), exact resume, throughput.

    For each method and each symbolic flag: iterate `cut_after` batches, write a
    `tf.train.Checkpoint` of the iterator, restore it into a freshly built pipeline and compare
    the next `compared` batches (indices and pixels) with an uninterrupted run's. Then one timed
    pass over the whole pipeline (warm: after the round trips). The private global shuffle is
    skipped, with a note, where this TensorFlow lacks it.
    """
    folder = Path(folder)
    rows = []
    for method in methods:
        if method == TF_GLOBAL_SHUFFLE and global_shuffle_op() is None:
            rows.append(BuiltinRow(method, spec.buffer_size, spec.n_samples, 0, 0, False, False, float("nan"), None,
                                   f"skipped: TensorFlow {tensorflow().__version__} has no global_shuffle_op."
                                   f"_global_shuffle (added in {GLOBAL_SHUFFLE_SINCE})"))
            continue
        uninterrupted = [e for _, e in zip(range(cut_after + compared), iter(shuffle_pipeline(spec, method)))]
        plain, symbolic = (_checkpoint_round_trip(replace(spec, symbolic=flag), method, folder, cut_after,
                                                  uninterrupted[cut_after:]) for flag in (False, True))
        seconds, order = _timed_pass(replace(spec, symbolic=True), method)
        rows.append(BuiltinRow(method, spec.buffer_size, spec.n_samples, plain[0], symbolic[0], plain[1],
                               symbolic[1], spec.n_samples / seconds, _same_order_in_numpy(spec, method, order)))
    shutil.rmtree(folder, ignore_errors=True)
    return rows


def builtins_table(rows) -> str:
    """The shuffles side by side: checkpoint bytes, exact resume, samples/s, order in numpy, needs."""
    lines = [f"{'shuffle':<24} {'plain ckpt':>10} {'symbolic':>9} {'exact':>11} {'samples/s':>10} "
             f"{'numpy order':>11}  needs"]
    for r in rows:
        if r.skipped:
            lines.append(f"{r.method:<24} {r.skipped}")
            continue
        same = "-" if r.same_order_in_numpy is None else str(r.same_order_in_numpy)
        lines.append(f"{r.method:<24} {_b(r.plain_bytes):>10} {_b(r.symbolic_bytes):>9} "
                     f"{f'{r.exact_plain}/{r.exact_symbolic}':>11} {r.samples_per_s:>10,.0f} {same:>11}  {r.needs}")
    return "\n".join(lines)


def builtins_conclusion(rows) -> str:
    """What the table says, computed: which shuffles checkpoint small and resume exactly, and how fast."""
    measured = [r for r in rows if not r.skipped]
    by = {r.method: r for r in measured}
    tf_row = by.get(TF_SHUFFLE)
    small = [r for r in measured if r.method != TF_SHUFFLE]
    lines = []
    if tf_row:
        lines.append(f"Dataset.shuffle's symbolic checkpoint is {_b(tf_row.symbolic_bytes)} for a buffer of "
                     f"{tf_row.buffer_size:,} ({tf_row.symbolic_bytes / max(1, tf_row.buffer_size):,.0f} B per "
                     "buffered sample): the buffer.")
    if small:
        lines.append(f"Every buffer-free shuffle checkpoints in <= {_b(max(r.symbolic_bytes for r in small))} "
                     f"symbolic ({', '.join(r.method for r in small)}).")
    exact = [r.method for r in measured if r.exact_plain and r.exact_symbolic]
    lines.append(f"Exact resume (plain and symbolic): {len(exact)} of {len(measured)}"
                 + (f"; not: {', '.join(r.method for r in measured if r.method not in exact)}"
                    if len(exact) < len(measured) else "") + ".")
    if tf_row:
        lines.append("Throughput vs Dataset.shuffle: " + ", ".join(
            f"{r.method} {r.samples_per_s / tf_row.samples_per_s:.2f}x" for r in small) + ".")
    twins = [r.method for r in measured if r.same_order_in_numpy]
    lines.append(f"Same order in numpy (and torch, nblib.shuffle): {', '.join(twins) or 'none'}; "
                 "TensorFlow's own orders exist only in TF.")
    lines.extend(f"{r.method}: {r.skipped}" for r in rows if r.skipped)
    return "\n".join(lines)


# --------------------------------------------------------------------------- shuffle quality


@dataclass(frozen=True)
class QualityRow:
    """Shuffle quality of one algorithm at one buffer size (nblib.shuffle.shuffle_quality)."""

    algorithm: str                 # "tf.data shuffle", "resumable (buffer)", "resumable (global)"
    buffer_size: int
    n_samples: int
    episode_len: int
    same_episode_share: float      # neighbouring outputs from the same episode
    same_episode_share_random: float  # what a full random permutation gives: (k-1)/(n-1)
    spearman: float                # rank correlation output position vs source index (1 = none)
    displacement_mean_vs_random: float  # mean |position - index| / n/3 (1 = as far as random)


def quality_vs_buffer(n: int, buffer_sizes, episode_len: int, seed: int = 0) -> list[QualityRow]:
    """Quality of tf.data's shuffle, ResumableShuffleBuffer (same algorithm) and GlobalShuffle."""
    from nblib import shuffle

    rows = []
    global_q = shuffle.shuffle_quality(shuffle.full_order(make_shuffle(n, 1, seed, "global")), episode_len)
    for b in (int(b) for b in buffer_sizes):
        for name, order in ((TF_SHUFFLE, tf_shuffle_order(n, b, seed)),
                            (resumable_label("buffer"), shuffle.full_order(make_shuffle(n, b, seed, "buffer")))):
            rows.append(_quality_row(name, b, episode_len, shuffle.shuffle_quality(order, episode_len)))
        rows.append(_quality_row(resumable_label("global"), b, episode_len, global_q))
    return rows


def predicted_same_episode_share(buffer_size: int, episode_len: int) -> float:
    """Rule of thumb fitted to measurements: k / (k + 2B) for episodes of k and a buffer of B."""
    return episode_len / (episode_len + 2 * max(1, buffer_size))


def buffer_needed(episode_len: int, target_share: float = 0.01) -> int:
    """The buffer giving a same-episode neighbour share of `target_share`: k (1 - s) / (2 s)."""
    if not 0 < target_share < 1:
        raise ConfigError(f"target_share={target_share} must be in (0, 1), e.g. 0.01 for 1%")
    return max(1, int(np.ceil(episode_len * (1 - target_share) / (2 * target_share))))


def smallest_buffer_meeting(rows, target_share: float, algorithm: str = TF_SHUFFLE) -> int | None:
    """The smallest measured buffer whose same-episode share is <= target (None if none is)."""
    ok = [r.buffer_size for r in rows if r.algorithm == algorithm and r.same_episode_share <= target_share]
    return min(ok) if ok else None


def quality_table(rows) -> str:
    """Shuffle-quality rows as a text table."""
    lines = [f"{'algorithm':<18} {'buffer':>7} {'same-episode':>12} {'random':>7} {'spearman':>8} "
             f"{'displacement':>12}"]
    for r in rows:
        lines.append(f"{r.algorithm:<18} {r.buffer_size:>7,} {r.same_episode_share:>12.4f} "
                     f"{r.same_episode_share_random:>7.4f} {r.spearman:>8.4f} {r.displacement_mean_vs_random:>12.4f}")
    return "\n".join(lines)


def buffer_answer(rows, target_share: float = 0.01) -> str:
    """How big the buffer must be for the episodic source of `rows`: the rule and the measurement."""
    k, n = rows[0].episode_len, rows[0].n_samples
    rule = buffer_needed(k, target_share)
    measured = sorted({r.buffer_size for r in rows})
    near = min(measured, key=lambda b: abs(np.log(b / rule)))
    at_near = {r.algorithm: r.same_episode_share for r in rows if r.buffer_size == near}
    buffer_name, global_name = resumable_label("buffer"), resumable_label("global")
    meets = {name: smallest_buffer_meeting(rows, target_share, name) for name in (TF_SHUFFLE, buffer_name)}
    global_row = next(r for r in rows if r.algorithm == global_name)
    return "\n".join([
        f"Episodes of k={k:,} samples, n={n:,}: a same-episode neighbour share <= {target_share:.1%} needs a "
        f"buffer B >= k(1-s)/(2s) = {rule:,} samples ({rule / k:,.0f} episodes, {rule / n:.0%} of this dataset).",
        f"Measured at B={near:,}: {TF_SHUFFLE} {at_near[TF_SHUFFLE]:.2%}, {buffer_name} {at_near[buffer_name]:.2%}; "
        "smallest measured buffer meeting the target: "
        + ", ".join(f"{name} {b:,}" if b else f"{name} none" for name, b in meets.items()) + ".",
        f"A full shuffle gives {global_row.same_episode_share_random:.2%}; {global_name} measured "
        f"{global_row.same_episode_share:.2%} with no buffer at all.",
    ])


# ------------------------------------------------------------------------------- throughput


@dataclass(frozen=True)
class ThroughputRow:
    """Samples per second of one shuffle over the same in-memory source, iterated from Python."""

    name: str
    buffer_size: int
    sample_bytes: int
    samples: int
    seconds: float

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds else float("nan")


def shuffle_throughput(n: int, buffer_size: int, sample_kb: float, *, batch_size: int = 0,
                       seed: int = 0) -> list[ThroughputRow]:
    """ResumableShuffleBuffer from Python, tf.data's shuffle, and it in tf.data over one in-memory source.

    The source is a uint8 array [n, sample bytes] of random bytes, iterated from Python one
    sample at a time (`batch_size=0`) or in batches. Unbatched, the Python shuffle yields
    `source[i]` (a view, as a memory-mapped cache would) while tf.data copies each sample into its
    buffer and into an EagerTensor, so the ratio is mostly per-element overhead; batched, both copy
    every sample. Dataset construction is not timed; the first element is.
    """
    from nblib import shuffle

    tf = tensorflow()
    sample_bytes = PipelineSpec(sample_kb=sample_kb).sample_bytes
    source = np.random.default_rng(seed).integers(0, 256, size=(n, sample_bytes), dtype=np.uint8)
    order = make_shuffle(n, buffer_size, seed, "buffer")
    t0 = time.perf_counter()
    if batch_size:
        count = sum(len(source[chunk]) for chunk in _chunks(iter(order), batch_size))
    else:
        count = sum(1 for _ in shuffle.iter_samples(source, order))
    rows = [ThroughputRow("resumable (Python)", buffer_size, sample_bytes, count, time.perf_counter() - t0)]
    with tf.device("/CPU:0"):
        constant = tf.constant(source)
    del source
    tf_ds = tf.data.Dataset.from_tensor_slices(constant).shuffle(buffer_size, seed=seed)
    indexed_ds = index_dataset(make_shuffle(n, buffer_size, seed, "buffer"))
    if batch_size:
        tf_ds, indexed_ds = tf_ds.batch(batch_size), indexed_ds.batch(batch_size)
    indexed_ds = indexed_ds.map(lambda i: tf.gather(constant, i))
    for name, ds in ((TF_SHUFFLE, tf_ds), ("resumable in tf.data", indexed_ds)):
        t0 = time.perf_counter()
        count = sum(int(x.shape[0]) if batch_size else 1 for x in ds)
        rows.append(ThroughputRow(name, buffer_size, sample_bytes, count, time.perf_counter() - t0))
    return rows


# ------------------------------------------------------------------------ the widget's numbers


def checkpoint_and_quality(buffer_size: int, sample_kb: float, episode_len: int, fit: BytesFit, *,
                           state_bytes_per_element: float = 5.4, state_fixed_bytes: float = 400) -> dict:
    """Predicted checkpoint sizes (tf.data vs the resumable JSON state) and shuffle quality for one setting."""
    sample_bytes = PipelineSpec(sample_kb=sample_kb).sample_bytes
    tf_bytes = fit.predict(buffer_size, sample_bytes)
    state_bytes = state_fixed_bytes + state_bytes_per_element * buffer_size
    return {
        "buffer_size": buffer_size, "sample_bytes": sample_bytes, "episode_len": episode_len,
        "tf_checkpoint_bytes": tf_bytes,
        "tf_rotating_peak_bytes": budget.checkpoint_disk_peak(max(0, round(tf_bytes)), keep_previous=True),
        "tf_buffer_ram_bytes": buffer_size * sample_bytes, "state_bytes": state_bytes,
        "ratio": tf_bytes / state_bytes,
        "same_episode_share": predicted_same_episode_share(buffer_size, episode_len),
        "buffer_for_1pct": buffer_needed(episode_len, 0.01),
    }


def describe_setting(numbers: dict) -> str:
    """`checkpoint_and_quality`'s numbers as a few lines of text (the widget prints these)."""
    n = numbers
    return "\n".join([
        f"buffer {n['buffer_size']:,} x {n['sample_bytes']:,} B samples, episodes of {n['episode_len']:,}",
        f"tf.data checkpoint    {_b(n['tf_checkpoint_bytes']):>10}   (peak {_b(n['tf_rotating_peak_bytes'])} "
        f"while the previous one is kept; buffer in RAM {_b(n['tf_buffer_ram_bytes'])})",
        f"resumable state JSON  {_b(n['state_bytes']):>10}   ({n['ratio']:,.0f}x smaller)",
        f"same-episode neighbours ~{n['same_episode_share']:.2%}; a 1% share needs a buffer of "
        f">= {n['buffer_for_1pct']:,}",
    ])


# ---------------------------------------------------------------------------------- helpers


def _checkpoint_round_trip(spec: PipelineSpec, method: str, folder: Path, cut_after: int,
                           expected: list) -> tuple[int, bool]:
    """(checkpoint bytes, exact resume) of `method` cut after `cut_after` batches; `expected`: what follows."""
    tf = tensorflow()
    where = folder / f"{method.replace(' ', '_').replace('(', '').replace(')', '')}-s{int(spec.symbolic)}"
    shutil.rmtree(where, ignore_errors=True)
    iterator = iter(shuffle_pipeline(spec, method))
    for _ in range(cut_after):
        next(iterator)
    path = tf.train.Checkpoint(iterator=iterator).write(str(where / "ckpt"))
    size = folder_bytes(where)
    del iterator
    fresh = iter(shuffle_pipeline(spec, method))
    tf.train.Checkpoint(iterator=fresh).read(path).expect_partial()
    resumed = [e for _, e in zip(range(len(expected)), fresh)]
    exact = len(resumed) == len(expected) and all(same_element(a, b) for a, b in zip(expected, resumed))
    shutil.rmtree(where, ignore_errors=True)
    return size, exact


def _timed_pass(spec: PipelineSpec, method: str) -> tuple[float, np.ndarray]:
    """Seconds of one full pass (construction not timed) and the order of the indices it yielded."""
    ds = shuffle_pipeline(spec, method)
    t0 = time.perf_counter()
    order = [np.asarray(e["index"]).reshape(-1) for e in ds]
    return time.perf_counter() - t0, np.concatenate(order)


def _same_order_in_numpy(spec: PipelineSpec, method: str, order: np.ndarray) -> bool | None:
    """nblib's shuffles: TF's order == numpy's (`shuffle.full_order`); TensorFlow's own: None."""
    from nblib import shuffle

    if not SHUFFLE_METHODS[method].same_order_outside_tf:
        return None
    algorithm = method.removeprefix("resumable (").removesuffix(")")
    numpy_order = shuffle.full_order(make_shuffle(spec.n_samples, spec.buffer_size, spec.seed, algorithm))
    return bool(np.array_equal(order, numpy_order))


def _tf_rows(rows) -> list[CheckpointRow]:
    """The successful rows of tf.data's own shuffle."""
    return [r for r in rows if not r.error and r.pipeline == TF_SHUFFLE]


def _quality_row(name: str, buffer_size: int, episode_len: int, q: dict) -> QualityRow:
    return QualityRow(name, buffer_size, q["n"], episode_len, q["same_episode_share"],
                      q["same_episode_share_random"], q["spearman"], q["displacement_mean_vs_random"])


def _chunks(iterator, size: int):
    """Lists of up to `size` items from `iterator`."""
    while chunk := [x for _, x in zip(range(size), iterator)]:
        yield chunk


def _b(n_bytes: float) -> str:
    """Bytes with one decimal in the largest decimal unit: '1.2 KB', '125.0 GB'."""
    return fmt_bytes(n_bytes, 1)
