"""The records notebook 04's experiments return: ops, JSON states, resume proofs, shuffles side by side, quality, speed.

Plain frozen dataclasses (no TensorFlow): experiments fill them, nblib's tables and plots read them.
"""
from __future__ import annotations

from dataclasses import dataclass

from nblib.tfdata import SHUFFLE_METHODS, TF_GLOBAL_SHUFFLE, TF_SHUFFLE


@dataclass(frozen=True)
class OpRow:
    """What one small pipeline's iterator checkpoint writes, plain or symbolic."""

    pipeline: str
    symbolic: bool
    bytes_on_disk: int             # 0 when TensorFlow refused to save
    error: str = ""


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


@dataclass(frozen=True)
class ResumeProof:
    """A tf.train.Checkpoint round trip: cut, save, restore into a fresh pipeline, compare."""

    algorithm: str
    cut_after: int                 # elements consumed before the save
    compared: int                  # elements compared after the restore
    identical: bool                # every compared element (indices and pixels) is equal
    next_indices: tuple[int, ...]  # the first indices after the cut (restored run)
    checkpoint_bytes: int


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
    samples_per_s: float           # the median full pass over the pipeline (symbolic), samples and pixels
    same_order_in_numpy: bool | None  # TF's order == nblib.shuffle.full_order (None: no numpy twin)
    skipped: str = ""              # why the method was not measured (e.g. missing in this TensorFlow)
    versus_tf: object = None       # nblib.verdict.PairedVerdict: passes paired with Dataset.shuffle's (None for it)

    @property
    def needs(self) -> str:
        """What the method needs, in words."""
        m = SHUFFLE_METHODS[self.method]
        needs = [("random access" + (" in every op before it" if self.method == TF_GLOBAL_SHUFFLE else ""))
                 if m.random_access else "any stream", "known size" if m.known_size else "",
                 f"TF >= {m.since_tf}" if m.since_tf != "any" else "", "" if m.public else "private API",
                 f"{self.buffer_size:,} samples in RAM" if self.method == TF_SHUFFLE else ""]
        return ", ".join(n for n in needs if n)


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
