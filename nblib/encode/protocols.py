"""What encode needs from its inputs: an image source to read and a store to write parts to.

`ImageSource` is what `ShardedImageCache` offers (any object with these members works, e.g. an
in-memory array for a test); `PartStore` is the part of `DurableStore` a run and its
consolidation call. Both are `typing.Protocol`s, checked once at the door by `require_*`, so
the code below never guesses with getattr or hasattr.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from nblib.errors import ConfigError
from nblib.store.parts import PartFolder, PartInfo, VerifyLevel

__all__ = [
    "ImageSource", "PartStore", "require_image_source", "require_part_store",
]

@runtime_checkable
class ImageSource(Protocol):
    """Fixed-order images: `len`, whether all are there, their size, a fingerprint, batches."""

    @property
    def complete(self) -> bool:
        """True when every image the source should hold is there."""

    @property
    def image_size(self) -> int:
        """Side of the square images, in pixels."""

    @property
    def fingerprint(self) -> str:
        """A string that changes when any image (or how they were made) changes."""

    def __len__(self) -> int: ...

    def get_batch(self, start: int, stop: int) -> np.ndarray:
        """Images [start, stop) as one uint8 array [n, H, W, 3]."""


@runtime_checkable
class PartStore(Protocol):
    """The DurableStore calls encode makes: parts, the run manifest, the mirror's progress."""

    local_dir: Path

    @property
    def local(self) -> PartFolder:
        """The local staging side's parts, read without touching the mirror."""

    @property
    def mirror_lag(self) -> int:
        """Parts not yet verified on the mirror (0 without one)."""

    def write_part(self, name: str, arrays: dict[str, np.ndarray], meta: dict | None = None) -> Any: ...

    def list_parts(self, verify: VerifyLevel = VerifyLevel.HASH) -> list[PartInfo]: ...

    def read_part(self, name: str, mmap: bool = True,
                  verify: VerifyLevel = VerifyLevel.HASH) -> dict[str, np.ndarray]: ...

    def write_manifest(self, obj: dict) -> Any: ...

    def read_manifest(self, local_only: bool = False) -> dict | None: ...

    def mirror_status(self) -> Any:
        """The mirror's state (failing, paused, ...): a MirrorStatus."""

    def verify(self) -> tuple[list, list]:
        """Every part hashed on every side: (verified parts, damaged copies)."""

    def delete_part(self, name: str) -> None: ...

    def close(self, timeout: float | None = None) -> bool: ...


def require_image_source(source) -> ImageSource:
    """`source` itself when it has every ImageSource member; ConfigError naming what is missing."""
    return _require(source, ImageSource, "an image source", "pass a ShardedImageCache")


def require_part_store(store) -> PartStore:
    """`store` itself when it has every PartStore member; ConfigError naming what is missing."""
    return _require(store, PartStore, "a part store", "pass an nblib.store.DurableStore")


def _require(obj, protocol: type, what: str, advice: str):
    if isinstance(obj, protocol):
        return obj
    missing = [m for m in sorted(_members(protocol)) if not hasattr(obj, m)]
    raise ConfigError(f"{type(obj).__name__} is not {what}: it lacks {', '.join(missing) or 'members'}; "
                      f"{advice}")


def _members(protocol: type) -> set[str]:
    """The attribute names a protocol asks for (its annotations and its public callables)."""
    names = set(vars(protocol).get("__annotations__", {}))
    names |= {n for n in vars(protocol) if not n.startswith("_") or n == "__len__"}
    return names - {"__annotations__"}
