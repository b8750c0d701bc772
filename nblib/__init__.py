"""nblib: the thin module behind the notebook suite.

`import nblib` stays light (no torch, no TensorFlow): each concern is its own module, imported
when used, e.g. `from nblib import budget` or `nblib.config.preset("smoke")`.
"""
from __future__ import annotations

import importlib
import os

from nblib.errors import (
    BudgetExceeded,
    CacheError,
    ConfigError,
    DriveError,
    EmptyPipelineError,
    FolderBusyError,
    InputError,
    LockLostError,
    ManifestDamaged,
    NblibError,
    PeerLost,
    ResumeMismatch,
    StateError,
    WeightsError,
)

__version__ = "0.1.0"

# TensorFlow's C++ logs (absl's "All log messages before absl::InitializeLog()", oneDNN's notice)
# print when TF is imported unless these are set before: every nblib path imports nblib first, and
# notebook kernels started by `nblib suite` inherit them. oneDNN off only changes float round-off in
# ops this suite runs in tf.data (none: it decodes and batches uint8). A user's own setting wins.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

_SUBMODULES = (
    "atomic", "budget", "cache", "cli", "config", "encode", "env", "lab", "lock", "manifest", "measure", "models",
    "pipeline", "plots", "proc", "reference", "render", "shuffle", "store", "suite", "t4_speed", "tfdata", "trm",
    "units", "widgets",
)

__all__ = [
    "BudgetExceeded", "CacheError", "ConfigError", "DriveError", "EmptyPipelineError", "FolderBusyError",
    "InputError", "LockLostError", "ManifestDamaged", "NblibError", "PeerLost", "ResumeMismatch",
    "StateError", "WeightsError", "__version__", *_SUBMODULES,
]


def __getattr__(name: str):
    """Import a submodule on first use, so `nblib.budget` works without importing everything."""
    if name in _SUBMODULES:
        return importlib.import_module(f"nblib.{name}")
    raise AttributeError(f"module 'nblib' has no attribute {name!r}")
