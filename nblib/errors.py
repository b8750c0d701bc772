"""The one error type of nblib and its subclasses.

Every user-facing failure raises a subclass of `NblibError`. Its message names what is wrong,
the numbers, and what to do; `python -m nblib` prints it as one line, without a traceback. Every
class lives here (the modules that raise them re-export their own: `nblib.lock.FolderBusyError`
is this `FolderBusyError`).
"""
from __future__ import annotations

import contextlib
import os

__all__ = [
    "BudgetExceeded", "CacheError", "ConfigError", "DeterminismError", "DriveError", "EmptyPipelineError",
    "FolderBusyError", "InputError", "LockLostError", "ManifestDamaged", "MissingDependency", "ModelOutputError",
    "ModelSpecError", "NblibError", "NotebookStalled", "PeerLost", "ResumeMismatch", "StateError",
    "TrainingDiverged", "WeightsError", "os_errors_name", "require_choice",
]


def one_line(what, limit: int | None = None) -> str:
    """An exception's (or a text's) message on one line, whitespace collapsed, cut at `limit` characters."""
    text = " ".join(str(what).split())
    return text if limit is None or len(text) <= limit else text[:limit - 3] + "..."


def require_choice(name: str, value, choices: tuple) -> None:
    """ConfigError naming `name`, the value and the choices unless `value` is one of `choices`."""
    if value not in choices:
        raise ConfigError(f"{name}={value!r} is unknown; choose one of {choices}")


@contextlib.contextmanager
def os_errors_name(folder):
    """An OSError that names no path (a write into an open file: ENOSPC) names the folder being written."""
    try:
        yield
    except OSError as exc:
        if isinstance(exc, NblibError) or exc.filename is not None or not exc.errno:
            raise
        raise OSError(exc.errno, os.strerror(exc.errno), str(folder)) from exc


class NblibError(Exception):
    """Base of every user-facing nblib failure: the message says what is wrong and what to do."""


class ConfigError(NblibError, ValueError):
    """A config field, profile name or device name is out of range or unknown."""


class DriveError(NblibError, OSError):
    """The durable workspace (Google Drive or its local fallback) is missing or not writable."""


class BudgetExceeded(NblibError):
    """A job's predicted peak RAM, VRAM or disk does not fit what is free."""


class CacheError(NblibError):
    """An image cache is missing, damaged, or was built from other inputs."""


class InputError(NblibError, ValueError):
    """An input file cannot be read as the texts it should hold."""


class ResumeMismatch(NblibError):
    """A run or checkpoint on disk was made with another config, weights or source."""


class StateError(NblibError, ValueError):
    """A saved state (shuffle, iterator, manifest) is corrupt or belongs to something else."""


class ManifestDamaged(StateError):
    """A manifest is torn, edited, or of another kind: it cannot be trusted as it is."""


class WeightsError(ConfigError):
    """A weights file is for another model shape (or is not a weights file at all)."""


class ModelSpecError(ConfigError):
    """A --model spec cannot be built: bad form, unknown class or name, a factory that returns no nn.Module."""


class NotModelled(ConfigError):
    """A model holds a module whose GPU memory the budget's trace does not model (cuDNN's RNNs): refused by name."""


class ModelOutputError(NblibError, TypeError):
    """A model's forward returned something other than a tensor, a dict of tensors or a ModelOutput."""


class MissingDependency(NblibError, ImportError):
    """An optional package a model needs (transformers, timm, safetensors) is absent or does not load."""


class FolderBusyError(NblibError):
    """Another run holds the folder's lock: its pid, host and rank are in the message."""


class LockLostError(NblibError):
    """This run's lock file was taken over or removed while it was writing: stop before mixing outputs."""


class PeerLost(NblibError):
    """A rank of the launch died or stalled: the others stop instead of waiting for ever."""


class EmptyPipelineError(NblibError, ValueError):
    """A pipeline yielded no batch (or fewer than its warm-up) to measure."""


class DeterminismError(NblibError):
    """A run cannot be made reproducible here: an op without a deterministic kernel, or cuBLAS set up too early."""


class TrainingDiverged(NblibError):
    """A training step gave a non-finite loss or weights: nothing after the last good state is saved."""


class NotebookStalled(NblibError, TimeoutError):
    """A notebook run by the suite produced no output for longer than the runner's inactivity limit."""
