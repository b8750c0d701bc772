"""Notebook 04's arithmetic, free of TensorFlow: the bytes fit, the extrapolation, the checks, the quality rules.

bytes = fixed + buffer x bytes per element is fitted by least squares to measured rows,
extrapolated to the reference's checkpoint table (nblib.reference.CHECKPOINT_TABLE) and set
against nblib.budget's disk model; every verdict is computed from a tolerance (nblib.verdict).
Rows come in as plain records (tfdata.CheckpointRow or anything with the same fields), so all of
this is testable without TensorFlow. Trade-off: a straight line fits the measured range; far
outside it the per-element overhead is assumed constant.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from nblib import budget
from nblib.errors import ConfigError
from nblib.reference import CHECKPOINT_TABLE
from nblib.tfdata import TF_SHUFFLE, CheckpointRow
from nblib.verdict import TOLERANCE, within_tolerance
from nblib.verdict import verdict as verdict_word

REFERENCE_BUFFERS = CHECKPOINT_TABLE["shuffle buffers"].value
REFERENCE_SAMPLE_BYTES = CHECKPOINT_TABLE["sample size"].value
REFERENCE_TEMP_FACTOR = CHECKPOINT_TABLE["temporary space during a save"].value


def resumable_label(algorithm: str) -> str:
    """The name rows carry for nblib's shuffle `algorithm` ("buffer" or "global")."""
    return f"resumable ({algorithm})"


def symbolic_saving(rows) -> dict[int, float]:
    """Per buffer: the share of a plain tf.data checkpoint's bytes that symbolic checkpointing saves."""
    plain = {r.buffer_size: r.bytes_on_disk for r in _tf_rows(rows) if not r.symbolic}
    symbolic = {r.buffer_size: r.bytes_on_disk for r in _tf_rows(rows) if r.symbolic}
    return {b: 1 - symbolic[b] / plain[b] for b in sorted(plain) if b in symbolic}


def compression_ratio(random_row: CheckpointRow, constant_row: CheckpointRow) -> float:
    """How many times smaller the checkpoint of constant images is than that of random ones."""
    return random_row.bytes_on_disk / constant_row.bytes_on_disk


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
        tf = tf_checkpoint(fit, b, sample_bytes)
        reference = b * REFERENCE_SAMPLE_BYTES
        out.append(ExtrapolationRow(
            b, sample_bytes, reference, tuple(f * reference for f in REFERENCE_TEMP_FACTOR),
            tf["tf_checkpoint_bytes"], tf["tf_first_save_peak_bytes"], tf["tf_rotating_peak_bytes"],
            tf["tf_buffer_ram_bytes"], tf["tf_buffer_ram_bytes"] * restore_factor))
    return out


def tf_checkpoint(fit: BytesFit, buffer_size: int, sample_bytes: int) -> dict[str, float]:
    """The one answer for a tf.data shuffle checkpoint of `buffer_size` samples of `sample_bytes` B each.

    Its bytes from the fit (the measured per-element overhead kept), its peak disk from the budget's model
    (first save, previous checkpoint kept), and the buffer it holds in RAM. `extrapolate` (the reference
    table) and `checkpoint_and_quality` (the widget) both ask it, so one setting prints one figure.
    """
    predicted = fit.predict(buffer_size, sample_bytes)
    size = max(0, round(predicted))
    return {"tf_checkpoint_bytes": predicted,
            "tf_first_save_peak_bytes": float(budget.checkpoint_disk_peak(size, keep_previous=False)),
            "tf_rotating_peak_bytes": float(budget.checkpoint_disk_peak(size, keep_previous=True)),
            "tf_buffer_ram_bytes": float(buffer_size * sample_bytes)}


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
        """The measurement lies within `tolerance` of the value (or of the range's ends): nblib.verdict."""
        return within_tolerance(self.measured, self.expected, self.tolerance)

    @property
    def verdict(self) -> str:
        return verdict_word(self.right)


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


def checkpoint_and_quality(buffer_size: int, sample_kb: float, episode_len: int, fit: BytesFit, *,
                           state_bytes_per_element: float = 5.4, state_fixed_bytes: float = 400) -> dict:
    """Predicted checkpoint sizes (tf.data vs the resumable JSON state) and shuffle quality for one setting.

    `sample_kb` is decimal kB per sample (500 -> 500,000 B, the reference's basis); the tf.data figures are
    `tf_checkpoint`'s, the same as `extrapolate` prints for the reference table.
    """
    sample_bytes = round(sample_kb * 1000)
    tf = tf_checkpoint(fit, buffer_size, sample_bytes)
    state_bytes = state_fixed_bytes + state_bytes_per_element * buffer_size
    return {
        "buffer_size": buffer_size, "sample_bytes": sample_bytes, "episode_len": episode_len, **tf,
        "state_bytes": state_bytes, "ratio": tf["tf_checkpoint_bytes"] / state_bytes,
        "same_episode_share": predicted_same_episode_share(buffer_size, episode_len),
        "buffer_for_1pct": buffer_needed(episode_len, 0.01),
    }


def _tf_rows(rows) -> list[CheckpointRow]:
    """The successful rows of tf.data's own shuffle."""
    return [r for r in rows if not r.error and r.pipeline == TF_SHUFFLE]
