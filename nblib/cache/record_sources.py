"""Where records come from: any pickle (a stream of dumps, or one list, tuple or dict), `.npz` and `.pt` files.

`record_source(path)` looks at the file and returns a `RecordSource`: something that can be
iterated more than once (a resume or a repair reads the input again from its start) and that says
what it is for the manifest. The kinds:

- a pickle ("pickle-stream": records written by `pickle.dump` in a loop; "pickle-list": one pickled
  list, tuple or dict of records, of any size): read one record at a time by nblib's own unpickler
  (`nblib.cache.pickle_stream`; what it rebuilds and refuses: docs/formats.md, "Pickle safety");
  `trust=True` imports and runs what the file names, for a file you made yourself;
- `.npz`: arrays sharing a leading record axis (record i is {name: array[i]}; 1-d arrays give
  scalars), read row by row from the zip members, never a member whole;
- `.pt`: `torch.load(weights_only=True, mmap=True)` of a list of records, or a dict of tensors with a
  leading record axis. `trust=True` allows `weights_only=False` (runs the file's code).
"""
from __future__ import annotations

import pickle
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from nblib.cache.pickle_globals import record_fields
from nblib.cache.pickle_stream import pickle_kind, pickle_records
from nblib.cache.sources import not_regular
from nblib.errors import InputError


@dataclass(frozen=True)
class RecordSource:
    """An input of records that can be read again from its start; `describe()` goes into the manifest."""

    kind: str                       # "pickle-stream", "pickle-list", "npz", "pt"
    path: str
    bytes: int
    trust: bool = False
    extra: dict = field(default_factory=dict)

    def __iter__(self) -> Iterator[dict]:
        if self.kind.startswith("pickle"):
            return pickle_records(Path(self.path), self.trust, report=self.extra)
        return {"npz": _npz_records, "pt": _pt_records}[self.kind](Path(self.path), self.trust)

    def describe(self) -> dict:
        """What the manifest records of this input: kind, path and size."""
        return {"kind": self.kind, "path": self.path, "bytes": self.bytes}


def record_source(path: str | Path, *, trust: bool = False) -> RecordSource:
    """The `RecordSource` of a file: its kind from its suffix and first bytes.

    Args:
        path: a pickle (a stream of records, or one list, tuple or dict of them), `.npz` or `.pt` file.
        trust: import and run any global a pickle names (and `weights_only=False` for `.pt`): only for
            your own files.

    Raises:
        InputError (missing, not a regular file, empty, not a pickle).
    """
    path = Path(path).absolute()  # the manifest's path must lead back to it from any folder (repair)
    if not path.is_file():
        what = f"is {not_regular(path)}" if path.exists() else "does not exist"
        raise InputError(f"--records {path} {what}; pass a file: a pickle of records, an .npz "
                         f"or a .pt (a build reads its input again to resume or repair, so a pipe cannot serve)")
    size = path.stat().st_size
    if path.suffix == ".npz":
        return RecordSource("npz", str(path), size, trust)
    if path.suffix in (".pt", ".pth"):
        return RecordSource("pt", str(path), size, trust)
    return RecordSource(pickle_kind(path), str(path), size, trust)


# ====================================================================================== readers


def _npz_records(path: Path, trust: bool) -> Iterator[dict]:
    with zipfile.ZipFile(path) as archive:
        members = sorted(n for n in archive.namelist() if n.endswith(".npy"))
        if not members:
            raise InputError(f"--records {path} holds no arrays")
        readers = {m[:-4]: _NpyRows(archive.open(m), f"{path}:{m}") for m in members}
        counts = {name: r.shape[0] if r.shape else None for name, r in readers.items()}
        if len(set(counts.values())) != 1 or None in counts.values():
            raise InputError(f"--records {path}: its arrays' first dimensions are {counts}; an .npz of "
                             f"records has one leading record axis shared by every array (record i is "
                             f"{{name: array[i]}})")
        if not any(r.row_bytes for r in readers.values()) and next(iter(counts.values())):
            raise InputError(f"--records {path}: its arrays hold {next(iter(counts.values())):,} records of 0 bytes "
                             f"each ({', '.join(f'{n} {r.shape}' for n, r in readers.items())}); save arrays whose "
                             f"rows hold data")
        try:
            for _ in range(next(iter(counts.values()))):
                yield {name: reader.next_row() for name, reader in readers.items()}
        finally:
            for reader in readers.values():
                reader.close()


class _NpyRows:
    """Rows of one .npy stream (a zip member), read one at a time."""

    def __init__(self, stream, where: str):
        self.stream, self.where = stream, where
        version = np.lib.format.read_magic(stream)
        read_header = {(1, 0): np.lib.format.read_array_header_1_0,
                       (2, 0): np.lib.format.read_array_header_2_0}.get(version)
        if read_header is None:
            raise InputError(f"{where} is a .npy of format version {version}; save it with numpy's np.savez")
        self.shape, fortran, self.dtype = read_header(stream)
        if fortran or self.dtype.hasobject:
            raise InputError(f"{where} is {'Fortran-ordered' if fortran else 'an object array'}; save "
                             f"C-ordered numeric arrays (np.ascontiguousarray)")
        self.row_shape = self.shape[1:]
        self.row_bytes = int(np.prod(self.row_shape, dtype=np.int64)) * self.dtype.itemsize

    def next_row(self):
        data = self.stream.read(self.row_bytes)
        if len(data) != self.row_bytes:
            raise InputError(f"{self.where} is cut short; the archive is damaged")
        row = np.frombuffer(bytearray(data), dtype=self.dtype).reshape(self.row_shape)
        return row.item() if row.ndim == 0 else row

    def close(self):
        self.stream.close()


def _pt_records(path: Path, trust: bool) -> Iterator[dict]:
    import torch

    with open(path, "rb") as f:
        zipped = f.read(4) == b"PK\x03\x04"   # torch's zip format: memory-mapped
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=not trust, mmap=zipped)
    except pickle.UnpicklingError as exc:
        raise InputError(f"--records {path} does not load with torch.load(weights_only=True) "
                         f"({str(exc).splitlines()[0]}); save plain tensors, or pass trust=True "
                         f"(--trust-pickle) for a file you made yourself") from None
    if isinstance(loaded, dict) and all(hasattr(v, "shape") and len(v.shape) for v in loaded.values()):
        lengths = {k: int(v.shape[0]) for k, v in loaded.items()}
        if len(set(lengths.values())) != 1:
            raise InputError(f"--records {path}: its tensors' first dimensions are {lengths}; a dict of "
                             f"tensors needs one leading record axis")
        for i in range(next(iter(lengths.values()))):
            yield {k: (v[i].item() if v[i].ndim == 0 else v[i]) for k, v in loaded.items()}
        return
    if not isinstance(loaded, (list, tuple)):
        raise InputError(f"--records {path} holds a {type(loaded).__name__}; a .pt of records holds a list "
                         f"of records, or a dict of tensors with a leading record axis")
    for record in loaded:
        yield record_fields(record)
