"""Training on the cached images whose state (model, optimizer, RNG, data order) resumes exactly.

- `config`: `TrainConfig` (the knobs; which of them a resume must match).
- `data`: labels that come free with the texts (kind, script), the held-out split, `BatchPlan`
  (the global sample order as a shuffle state of a few hundred bytes, the same on any world size).
- `model`: `Classifier`, the TRM encoder with gradients through its last outer cycle, plus a head.
- `task`: what a run trains on and with: `ImageTask` (the cache's images and labels; the TRM, or any
  model of `nblib.models` with a head on its output or its own logits: `--model SPEC`).
- `records`: `RecordTask`, record shards read one shard at a time (`--records DIR --input-key X
  --target-key Y`), with a per-token linear model or any model, ce or mse.
- `state`: what a checkpoint holds, RNG capture/restore, the identity check of a resume.
- `store`: `TrainStore`, local-first states mirrored to Drive or a bucket by nblib.store's thread.
- `objstore`: fsspec (s3://, gs://) as the mirror's file operations.
- `loop`: `train`, the loop behind `python -m nblib train` and notebook 06.
- `evaluate`: `predict_images`, a finished image run scored on a labelled cache (`python -m nblib predict --run
  RUN --cache TEST_CACHE --out DIR`: predictions.csv, accuracy, per class, the confusion matrix).
- `ops`: bucket cost from a dated price table, disk and Drive-quota warnings.
- `device`: the device check (cuda by default when present), strict determinism, dropout's keys.
torch is imported when `train` (or a module that needs it) is first used, not by `import nblib`.
Importing this package sets CUBLAS_WORKSPACE_CONFIG=:4096:8 unless it is set: cuBLAS is
reproducible only with it, and torch reads it once, at the first CUDA matrix product, so it
must be there before any CUDA cell runs (`nblib.train.device`).
"""
from __future__ import annotations

import os

from nblib.train import traced  # noqa: F401  (hands the training job to the trace layer: nblib.budget.traced_jobs)
from nblib.train.config import TrainConfig

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

__all__ = ["TrainConfig", "TrainReport", "train", "TrainStore"]


def __getattr__(name: str):
    if name in ("train", "TrainReport"):
        from nblib.train import loop

        return getattr(loop, name)
    if name == "TrainStore":
        from nblib.train.store import TrainStore

        return TrainStore
    raise AttributeError(f"module 'nblib.train' has no attribute {name!r}")
