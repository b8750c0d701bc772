"""Notebook 04's experiment: tf.data shuffle checkpoints measured, fitted, set against the reference.

Sweeps real tf.data iterator checkpoints over buffer sizes, fits bytes = fixed + buffer x bytes
per element, extrapolates the reference's checkpoint table, and compares the measured peak disk
with nblib.budget's model and with the reference's claim; every verdict is computed from a
tolerance. Also: which tf.data ops keep a checkpoint small, the resumable shuffles' JSON state, an
exact-resume proof, TensorFlow's own buffer-free shuffles beside Dataset.shuffle and nblib's,
shuffle quality against buffer size, and throughput. Its modules (maths, rows, experiments, tables):
docs/layout.md. The notebook imports this package as `lab`; every name it calls is re-exported here.
"""
from __future__ import annotations

from nblib.lab.shuffle_checkpoints.experiments import (
    compare_shuffles,
    measure_checkpoint,
    measure_ops,
    measure_state_checkpoint,
    quality_vs_buffer,
    resume_proof,
)
from nblib.lab.shuffle_checkpoints.maths import (
    REFERENCE_SAMPLE_BYTES,
    BytesFit,
    Check,
    buffer_needed,
    checkpoint_and_quality,
    compression_ratio,
    disk_model_checks,
    extrapolate,
    fit_bytes_per_element,
    measured_factors,
    predicted_same_episode_share,
    reference_checks,
    symbolic_saving,
)
from nblib.lab.shuffle_checkpoints.rows import BuiltinRow
from nblib.lab.shuffle_checkpoints.tables import (
    buffer_answer,
    builtins_conclusion,
    builtins_table,
    checkpoint_table,
    checks_table,
    comparison_table,
    describe_setting,
    extrapolation_table,
    ops_table,
    quality_table,
    ram_note,
)
from nblib.verdict import TOLERANCE

__all__ = [
    "TOLERANCE", "REFERENCE_SAMPLE_BYTES", "BytesFit", "Check", "BuiltinRow",
    "measure_checkpoint", "measure_ops", "measure_state_checkpoint", "resume_proof", "compare_shuffles",
    "quality_vs_buffer",
    "symbolic_saving", "compression_ratio", "fit_bytes_per_element", "extrapolate", "measured_factors",
    "disk_model_checks", "reference_checks", "predicted_same_episode_share", "buffer_needed", "checkpoint_and_quality",
    "checkpoint_table", "extrapolation_table", "checks_table", "ram_note", "ops_table", "comparison_table",
    "builtins_table", "builtins_conclusion", "quality_table", "buffer_answer", "describe_setting",
]
