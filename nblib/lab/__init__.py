"""One module per notebook: its demos, reference comparisons and projections (narrative lives here).

Core packages (cache, store, encode, shuffle, budget, ...) stay reusable and free of narrative;
what a single notebook shows, compares or concludes lives in its `lab` module. Verdicts are
computed from tolerances, never typed.
"""
import importlib

from nblib import encode  # noqa: F401  hands the encode job to the trace layer; train's: the labs that train import it

__all__ = ["cache_population", "input_pipeline", "memory_budgeting", "shuffle_checkpoints", "streaming_encoding",
           "your_model"]


def __getattr__(name: str):
    """Import a notebook's lab module on first use (`nblib.lab.memory_budgeting`)."""
    if name in __all__:
        return importlib.import_module(f"nblib.lab.{name}")
    raise AttributeError(f"module 'nblib.lab' has no attribute {name!r}")
