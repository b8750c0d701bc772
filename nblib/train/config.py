"""A training run's knobs as one frozen dataclass, and the fingerprint a resume must match.

`TrainConfig` holds what changes the arithmetic of a run (model preset, labels, batch, steps,
optimizer, schedule, precision, device, seed) and what only changes how it is kept (save and
backup intervals, retention, loader workers). Only the first kind enters `fingerprint()`: a
resume with another batch size or precision is refused naming the field, a resume with other
loader workers or another save interval is allowed, because the bytes do not depend on them.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields

from nblib.config import SEED_LIMIT
from nblib.errors import ConfigError, require_choice

LABELS = ("kind", "script")
PRECISIONS = ("fp32", "bf16", "fp16")
METRICS = ("heldout_loss", "heldout_accuracy")
EVAL_BATCH = 64                 # images (records) per forward when evaluating or predicting
# fields that change no byte of the trained weights (how the run is kept, not what it computes)
OPERATIONAL = ("save_every", "backup_every", "keep_last", "eval_every", "workers", "best_metric")


@dataclass(frozen=True)
class TrainConfig:
    """One training run: the TRM encoder of `profile` plus a linear head, AdamW, warmup + cosine.

    batch_size is the global batch (all ranks, all accumulation micro-batches together);
    accumulation splits it into micro-batches of batch_size // accumulation per rank.
    """

    profile: str = "smoke"
    labels: str = "kind"
    steps: int = 40
    batch_size: int = 32
    accumulation: int = 1
    lr: float = 2e-3
    weight_decay: float = 0.05
    warmup_steps: int = 5
    holdout: float = 0.2
    dropout: float = 0.1            # on the head's input: drawn from the torch RNG, which the state keeps
    precision: str = "fp32"
    device: str | None = None       # None: cuda when a GPU is present, else cpu (resolved here, so never None)
    seed: int = 0
    save_every: int = 5             # local checkpoint interval (steps)
    backup_every: int = 10          # mirror (Drive / bucket) interval (steps), a multiple of save_every
    keep_last: int = 3              # full train states kept on each side
    eval_every: int = 10
    best_metric: str = "heldout_loss"
    workers: int = 0

    def __post_init__(self):
        from .device import check_device

        object.__setattr__(self, "device", check_device(self.device))
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type in ("int", int) and (isinstance(value, bool) or not isinstance(value, int)):
                raise ConfigError(f"train.{f.name}={value!r} must be an integer")
        for name, low in (("steps", 1), ("batch_size", 1), ("accumulation", 1), ("save_every", 1),
                          ("backup_every", 1), ("keep_last", 1), ("eval_every", 1), ("warmup_steps", 0),
                          ("workers", 0), ("seed", 0)):
            if getattr(self, name) < low:
                raise ConfigError(f"train.{name}={getattr(self, name)} is out of range; use an integer >= {low}")
        if self.seed >= SEED_LIMIT:
            raise ConfigError(f"train.seed={self.seed} is out of range; use an integer from 0 to 2**64 - 1")
        require_choice("train.labels", self.labels, LABELS)
        require_choice("train.precision", self.precision, PRECISIONS)
        require_choice("train.best_metric", self.best_metric, METRICS)
        if self.batch_size % self.accumulation:
            fits = self.batch_size // self.accumulation * self.accumulation or self.accumulation
            raise ConfigError(f"train.batch_size={self.batch_size} is not a multiple of accumulation="
                              f"{self.accumulation}; use a batch of {fits}")
        if self.backup_every % self.save_every:
            raise ConfigError(f"train.backup_every={self.backup_every} is not a multiple of save_every="
                              f"{self.save_every}: a backup copies a local save; use "
                              f"{backup_multiple(self.backup_every, self.save_every)}")
        if not 0.0 < self.holdout < 1.0:
            raise ConfigError(f"train.holdout={self.holdout} must be a fraction in (0, 1), e.g. 0.2")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"train.dropout={self.dropout} must be in [0, 1)")
        if not self.lr > 0:
            raise ConfigError(f"train.lr={self.lr} must be above 0")
        if self.precision == "fp16" and not self.device.startswith("cuda"):
            raise ConfigError("train.precision='fp16' needs a CUDA device (GradScaler); on CPU use fp32 or bf16")

    def replace(self, **changes) -> TrainConfig:
        try:
            return dataclasses.replace(self, **changes)
        except TypeError:
            known = ", ".join(f.name for f in fields(self))
            raise ConfigError(f"unknown train field in {sorted(changes)}; known: {known}") from None

    def computing(self) -> dict:
        """The fields that change the trained bytes (what a resume must match)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in OPERATIONAL}

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def micro_batch(self, world_size: int = 1) -> int:
        """Samples per forward pass on one rank."""
        per_rank, rest = divmod(self.batch_size, self.accumulation * world_size)
        if rest or per_rank < 1:
            raise ConfigError(f"batch_size={self.batch_size} does not split over accumulation={self.accumulation} "
                              f"x {world_size} ranks; use a multiple of {self.accumulation * world_size}")
        return per_rank


def backup_multiple(backup_every: int, save_every: int) -> int:
    """The multiple of `save_every` at or below `backup_every` (save_every itself when it is larger): the backup
    interval nearest the one asked that backs up a local save.
    """
    return max(1, backup_every // save_every) * save_every
