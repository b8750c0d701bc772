"""Notebook 04's measurements: real tf.data iterator checkpoints, one-op pipelines, JSON states, resumes, speed.

Each experiment saves and restores real iterators through nblib.tfdata's public functions and
returns rows (`rows`); the arithmetic over them is `maths` and the text is `tables`. Every
temporary folder an experiment makes is removed in a `finally`, so an exception (a full disk, a
TensorFlow refusal, Ctrl-C) leaves no nblib-tfckpt-* folder behind. Trade-off: real checkpoints
cost seconds per buffer size, which is why sizes are small in the smoke profile.
"""
from __future__ import annotations

import functools
import shutil
import statistics
import tempfile
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import numpy as np

from nblib import shuffle
from nblib.compare import progress_bar
from nblib.lab.shuffle_checkpoints.maths import resumable_label
from nblib.lab.shuffle_checkpoints.rows import BuiltinRow, OpRow, QualityRow, ResumeProof, StateRow
from nblib.tfdata import (
    SHUFFLE_METHODS,
    TF_SHUFFLE,
    CheckpointRow,
    PipelineSpec,
    checkpoint_round_trip,
    iterator_checkpoint_bytes,
    make_shuffle,
    measure_iterator_checkpoint,
    method_unavailable,
    one_op_pipelines,
    preflight_checkpoint,
    shuffle_pipeline,
    tf_shuffle_order,
)
from nblib.verdict import MIN_PAIRS, against_base, paired_order


def measure_checkpoint(buffer_sizes, sample_kb: float, *, symbolic=(False, True), folder=None,
                       seed: int = 0, batch_size: int = 8, prefetch: int = 2, sources: int = 1,
                       content: str = "random", resumable: str | None = None,
                       steps: int = 3, progress: bool = False) -> list[CheckpointRow]:
    """Save and restore a real tf.data iterator per buffer size and symbolic flag; measure each.

    `resumable=None` measures tf.data's own shuffle; `resumable="buffer"|"global"` measures
    nblib's shuffle in the same pipeline instead (always symbolic). Each checkpoint is deleted
    once measured; before the first one a preflight refuses buffers that would not fit. `progress`:
    the suite's bar, one step per checkpoint.
    """
    buffer_sizes = [int(b) for b in buffer_sizes]
    symbolic = (True,) if resumable else tuple(symbolic)
    base = PipelineSpec(sample_kb=sample_kb, seed=seed, batch_size=batch_size, prefetch=prefetch,
                        sources=sources, content=content)
    label = resumable_label(resumable) if resumable else TF_SHUFFLE
    rows = []
    bar = progress_bar(len(buffer_sizes) * len(symbolic), "checkpoints", "save", disable=not progress)
    with bar, _work_folder(folder, "nblib-tfckpt-") as root:
        if not resumable:
            preflight_checkpoint(max(buffer_sizes), base.sample_bytes, root)
        for buffer_size in buffer_sizes:
            for flag in symbolic:
                spec = replace(base, buffer_size=buffer_size, symbolic=flag,
                               n_samples=buffer_size + (steps + 2 + prefetch) * max(1, batch_size) + 8)
                build = lambda s=spec: shuffle_pipeline(s, label)  # noqa: E731
                where = root / f"{label[:4]}-b{buffer_size}-s{int(flag)}"
                rows.append(measure_iterator_checkpoint(label, spec, build, where, steps))
                bar.update()
    return rows


def measure_ops(sample_kb: float = 16.0, *, n: int = 256, seed: int = 0, folder=None) -> list[OpRow]:
    """Checkpoint bytes of one-op pipelines after 5 elements, plain and symbolic: which ops keep a checkpoint small."""
    spec = PipelineSpec(n_samples=n, sample_kb=sample_kb, seed=seed)
    builds = {flag: one_op_pipelines(replace(spec, symbolic=flag)) for flag in (False, True)}
    rows = []
    with _work_folder(folder, "nblib-tfckpt-ops-") as root:
        for name in builds[False]:
            for symbolic in (False, True):
                # TensorFlow's refusal (e.g. "PyFunc is stateful") is the answer, not a crash
                size, refused = iterator_checkpoint_bytes(builds[symbolic][name](), 5, root / f"op-{len(rows)}")
                rows.append(OpRow(name, symbolic, size, refused))
    return rows


def measure_state_checkpoint(buffer_sizes, *, algorithm: str = "buffer", n_factor: int = 4, seed: int = 0,
                             folder=None) -> list[StateRow]:
    """Save and restore a resumable shuffle's JSON state mid-epoch (buffer full) for each buffer size."""
    rows = []
    with _work_folder(folder, "nblib-tfckpt-state-") as root:
        for buffer_size in (int(b) for b in buffer_sizes):
            n = max(2, n_factor * buffer_size)
            shuffler = make_shuffle(n, buffer_size, seed, algorithm)
            iterator = iter(shuffler)
            for _ in range(n // 2):
                next(iterator)
            path = root / f"state-{algorithm}-{buffer_size}.json"
            try:
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
            finally:
                path.unlink(missing_ok=True)
    return rows


def resume_proof(spec: PipelineSpec, folder, *, algorithm: str = "buffer", cut_after: int = 10,
                 compared: int = 50) -> ResumeProof:
    """Cut the resumable pipeline after `cut_after` elements, checkpoint, restore, compare `compared` more.

    The pipeline is nblib's shuffle with symbolic checkpointing; the checkpoint is written in
    `folder` and removed once measured (also on an exception).
    """
    method = resumable_label(algorithm)
    trip = checkpoint_round_trip(lambda: shuffle_pipeline(replace(spec, symbolic=True), method), folder,
                                 cut_after, compared, strict=True)
    first = np.asarray(trip.restored[0]["index"]).reshape(-1)[:8].tolist() if trip.restored else []
    return ResumeProof(algorithm, cut_after, len(trip.restored), trip.identical, tuple(first), trip.checkpoint_bytes)


def compare_shuffles(spec: PipelineSpec, folder, *, cut_after: int = 5, compared: int = 20,
                     methods=tuple(SHUFFLE_METHODS), passes: int = MIN_PAIRS,
                     progress: bool = False) -> list[BuiltinRow]:
    """Every shuffle method on the same pipeline: checkpoint bytes (plain, symbolic), exact resume, throughput.

    For each method and each symbolic flag: iterate `cut_after` batches, write a
    `tf.train.Checkpoint` of the iterator, restore it into a freshly built pipeline and compare
    the next `compared` batches (indices and pixels) with an uninterrupted run's. Then (warm: after the
    round trips) `passes` rounds time every method's full pass next to one of Dataset.shuffle's
    (`nblib.verdict.against_base`): samples/s is the median pass, `versus_tf` the paired verdict against
    Dataset.shuffle, and a method's first timed pass gives the order checked against numpy (one pass
    each where Dataset.shuffle is not measured). The private global shuffle is skipped, with a note,
    where this TensorFlow lacks it. `folder` is removed at the end, also on an exception. `progress`:
    the suite's bar, one step per method measured and per timed pass.
    """
    rows = []
    available = [m for m in methods if not method_unavailable(m)]
    timed = len(paired_order(len(available) - 1, passes)) if TF_SHUFFLE in available else len(available)
    bar = progress_bar(len(methods) + timed, "shuffles", "step", disable=not progress)
    with bar, _work_folder(folder, "nblib-tfckpt-builtins-", remove_given=True) as root:
        for method in methods:
            bar.update()
            skipped = method_unavailable(method)
            if skipped:
                rows.append(BuiltinRow(method, spec.buffer_size, spec.n_samples, 0, 0, False, False, float("nan"),
                                       None, skipped))
                continue
            uninterrupted = [e for _, e in zip(range(cut_after + compared), iter(shuffle_pipeline(spec, method)))]
            plain, symbolic = (_round_trip(replace(spec, symbolic=flag), method, root, cut_after,
                                           uninterrupted[cut_after:]) for flag in (False, True))
            rows.append(BuiltinRow(method, spec.buffer_size, spec.n_samples, plain.checkpoint_bytes,
                                   symbolic.checkpoint_bytes, plain.identical, symbolic.identical,
                                   float("nan"), None))
        return _timed_passes(rows, spec, passes, bar.update)


def _timed_passes(rows: list[BuiltinRow], spec: PipelineSpec, passes: int,
                  step=lambda: None) -> list[BuiltinRow]:
    """Each measured row's full passes: samples/s (the median pass) and the order of its first pass.

    With Dataset.shuffle measured, `verdict.against_base`: T m1 m2 T m3 m4 T ..., each method's pass
    next to one of Dataset.shuffle's, mirrored every other round, `passes` rounds; else one pass each.
    """
    timed, orders = replace(spec, symbolic=True), {}

    def rate(method: str) -> float:
        step()
        seconds, order = _timed_pass(timed, method)
        orders.setdefault(method, order)
        return spec.n_samples / seconds

    measured = [r.method for r in rows if not r.skipped]
    if TF_SHUFFLE in measured:
        others = [m for m in measured if m != TF_SHUFFLE]
        verdicts, values = against_base(lambda: rate(TF_SHUFFLE), {m: functools.partial(rate, m) for m in others},
                                        TF_SHUFFLE, passes)
    else:
        verdicts, values = {}, {m: [rate(m)] for m in measured}
    return [r if r.skipped else replace(r, samples_per_s=statistics.median(values[r.method]),
                                        versus_tf=verdicts.get(r.method),
                                        same_order_in_numpy=_same_order_in_numpy(spec, r.method, orders[r.method]))
            for r in rows]


def quality_vs_buffer(n: int, buffer_sizes, episode_len: int, seed: int = 0) -> list[QualityRow]:
    """Quality of tf.data's shuffle, ResumableShuffleBuffer (same algorithm) and GlobalShuffle."""
    rows = []
    global_q = shuffle.shuffle_quality(shuffle.full_order(make_shuffle(n, 1, seed, "global")), episode_len)
    for b in (int(b) for b in buffer_sizes):
        for name, order in ((TF_SHUFFLE, tf_shuffle_order(n, b, seed)),
                            (resumable_label("buffer"), shuffle.full_order(make_shuffle(n, b, seed, "buffer")))):
            rows.append(_quality_row(name, b, episode_len, shuffle.shuffle_quality(order, episode_len)))
        rows.append(_quality_row(resumable_label("global"), b, episode_len, global_q))
    return rows


@contextmanager
def _work_folder(folder, prefix: str, *, remove_given: bool = False):
    """`folder` (created if needed) or a fresh temporary folder named `prefix`...; yields it as a Path.

    The temporary folder (and `folder` too with `remove_given`) is removed on exit, exception or not.
    """
    given = folder is not None
    root = Path(folder) if given else Path(tempfile.mkdtemp(prefix=prefix))
    root.mkdir(parents=True, exist_ok=True)
    try:
        yield root
    finally:
        if remove_given or not given:
            shutil.rmtree(root, ignore_errors=True)


def _round_trip(spec: PipelineSpec, method: str, folder: Path, cut_after: int, expected: list):
    """tfdata.checkpoint_round_trip of `method` in a subfolder named after it, against `expected`."""
    where = folder / f"{method.replace(' ', '_').replace('(', '').replace(')', '')}-s{int(spec.symbolic)}"
    return checkpoint_round_trip(lambda: shuffle_pipeline(spec, method), where, cut_after, len(expected),
                                 expected=expected)


def _timed_pass(spec: PipelineSpec, method: str) -> tuple[float, np.ndarray]:
    """Seconds of one full pass (construction not timed) and the order of the indices it yielded."""
    ds = shuffle_pipeline(spec, method)
    t0 = time.perf_counter()
    order = [np.asarray(e["index"]).reshape(-1) for e in ds]
    return time.perf_counter() - t0, np.concatenate(order)


def _same_order_in_numpy(spec: PipelineSpec, method: str, order: np.ndarray) -> bool | None:
    """nblib's shuffles: TF's order == numpy's (`shuffle.full_order`); TensorFlow's own: None."""
    if not SHUFFLE_METHODS[method].same_order_outside_tf:
        return None
    algorithm = method.removeprefix("resumable (").removesuffix(")")
    numpy_order = shuffle.full_order(make_shuffle(spec.n_samples, spec.buffer_size, spec.seed, algorithm))
    return bool(np.array_equal(order, numpy_order))


def _quality_row(name: str, buffer_size: int, episode_len: int, q: dict) -> QualityRow:
    return QualityRow(name, buffer_size, q["n"], episode_len, q["same_episode_share"],
                      q["same_episode_share_random"], q["spearman"], q["displacement_mean_vs_random"])
