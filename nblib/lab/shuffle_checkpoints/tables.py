"""Notebook 04's rows as text: tables and the sentences a conclusion prints, computed from the rows.

Pure formatting over the records of `rows` and `maths` (no TensorFlow, no measuring).
"""
from __future__ import annotations

import numpy as np

from nblib import budget
from nblib.lab.shuffle_checkpoints.maths import (
    REFERENCE_SAMPLE_BYTES,
    REFERENCE_TEMP_FACTOR,
    Check,
    buffer_needed,
    measured_factors,
    resumable_label,
    smallest_buffer_meeting,
)
from nblib.tfdata import TF_SHUFFLE
from nblib.units import GB, MB, GiB, fmt_bytes
from nblib.verdict import TOLERANCE


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
             device: str = "t4") -> str:
    """The RAM a reference-sized buffer holds, against the device preset's usable RAM, and what save and restore add."""
    f = measured_factors(rows)
    held, ram_bytes = buffer_size * sample_bytes, budget.device_preset(device).ram_bytes
    return (f"a {buffer_size:,} x {sample_bytes / 1e3:.0f} kB shuffle buffer holds {held / GB:.0f} GB in RAM "
            f"before any save, {held / ram_bytes:.1f}x the {ram_bytes / GB:.1f} GB of RAM a job may use on a "
            f"{device} (nblib.budget.device_preset({device!r}).ram_bytes); measured, a save adds "
            f"{f['save_extra_ram_bytes'] / MB:.0f} MB and a restore {f['restore_ram_factor']:.2f}x the buffer")


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


def builtins_table(rows) -> str:
    """The shuffles side by side: checkpoint bytes, exact resume, samples/s (the median pass), the paired
    verdict's ratio and interval against Dataset.shuffle (not a ratio of the medians), order in numpy, needs.
    """
    versus = "vs Dataset.shuffle (paired)"
    lines = [f"{'shuffle':<24} {'plain ckpt':>10} {'symbolic':>9} {'exact':>11} {'samples/s':>10} {versus:>42} "
             f"{'numpy order':>11}  needs"]
    for r in rows:
        if r.skipped:
            lines.append(f"{r.method:<24} {r.skipped}")
            continue
        same = "-" if r.same_order_in_numpy is None else str(r.same_order_in_numpy)
        ratio = "the base" if r.versus_tf is None else r.versus_tf.head
        lines.append(f"{r.method:<24} {_b(r.plain_bytes):>10} {_b(r.symbolic_bytes):>9} "
                     f"{f'{r.exact_plain}/{r.exact_symbolic}':>11} {r.samples_per_s:>10,.0f} {ratio:>42} "
                     f"{same:>11}  {r.needs}")
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
    paired = [r for r in small if r.versus_tf is not None]
    if tf_row and paired:
        lines.append("Throughput against Dataset.shuffle, full passes in interleaved pairs:")
        lines.extend(f"  {r.method}: {r.versus_tf.short('faster', 'slower')}" for r in paired)
    twins = [r.method for r in measured if r.same_order_in_numpy]
    lines.append(f"Same order in numpy (and torch, nblib.shuffle): {', '.join(twins) or 'none'}; "
                 "TensorFlow's own orders exist only in TF.")
    lines.extend(f"{r.method}: {r.skipped}" for r in rows if r.skipped)
    return "\n".join(lines)


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


def _b(n_bytes: float) -> str:
    """Bytes with one decimal in the largest decimal unit: '1.2 KB', '125.0 GB'."""
    return fmt_bytes(n_bytes, 1)
