"""Training on the cached images whose state (model, optimizer, RNG, data order) resumes exactly.

`train` (nblib.train.loop) is the loop behind `python -m nblib train` and notebook 06; what each module does:
train/ in docs/layout.md, and docs/training.md section by section (state, store, objstore, ops, evaluate).
torch is imported when `train` (or a module that needs it) is first used, not by `import nblib`. Importing
this package sets CUBLAS_WORKSPACE_CONFIG=:4096:8 unless it is set: cuBLAS is reproducible only with it, and
torch reads it once, at the first CUDA matrix product, so it must be there before any CUDA cell runs
(`nblib.train.device`).
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
