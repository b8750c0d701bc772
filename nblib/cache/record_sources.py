"""Where records come from: a pickle stream, a pickled list (after a RAM preflight), `.npz` and `.pt` files.

`record_source(path)` looks at the file and returns a `RecordSource`: something that can be
iterated more than once (a resume or a repair reads the input again from its start) and that says
what it is for the manifest. The kinds:

- a pickle stream (records written by `pickle.dump` in a loop): read one record at a time, never
  the file whole (RAM: one record);
- a single pickled list (or tuple) of records: it can only be unpickled whole, so it is read only
  when the preflight says it fits (file size x LIST_RAM_FACTOR against the available RAM); else
  refused with the numbers and the one-line conversion to a stream. The kind is read from the
  pickle's first opcodes, before anything is unpickled;
- `.npz`: arrays sharing a leading record axis (record i is {name: array[i]}; 1-d arrays give
  scalars), read row by row from the zip members, never a member whole;
- `.pt`: `torch.load(weights_only=True, mmap=True)` of a list of dicts, or a dict of tensors with a
  leading record axis. `trust=True` allows `weights_only=False` (runs the file's code).

Unpickling runs code named in the file. Pickles are read with an allow-list of globals (numpy's
array reconstruction, a few builtins); `trust=True` lifts it for a file you made yourself.
"""
from __future__ import annotations

import io
import pickle
import pickletools
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from nblib.errors import BudgetExceeded, InputError
from nblib.units import fmt_bytes

LIST_RAM_FACTOR = 1.5   # measured: a 50 MB pickled trace list peaked 1.16x its file size while sharded; + margin
SAFE_BUILTINS = {"set", "frozenset", "complex", "slice", "range", "bytearray", "bytes", "tuple", "list", "dict"}
CONVERSION = ("python -c \"import pickle,sys; o=open(sys.argv[2],'wb'); "
              "[pickle.dump(r,o) for r in pickle.load(open(sys.argv[1],'rb'))]\" {path} {stream}")


@dataclass(frozen=True)
class RecordSource:
    """An input of records that can be read again from its start; `describe()` goes into the manifest."""

    kind: str                       # "pickle-stream", "pickle-list", "npz", "pt"
    path: str
    bytes: int
    trust: bool = False
    extra: dict = field(default_factory=dict)

    def __iter__(self) -> Iterator[dict]:
        readers = {"pickle-stream": _pickle_stream, "pickle-list": _pickle_list, "npz": _npz_records,
                   "pt": _pt_records}
        return readers[self.kind](Path(self.path), self.trust)

    def describe(self) -> dict:
        """What the manifest records of this input: kind, path and size."""
        return {"kind": self.kind, "path": self.path, "bytes": self.bytes}


def record_source(path: str | Path, *, trust: bool = False, available_ram: int | None = None) -> RecordSource:
    """The `RecordSource` of a file: its kind from its suffix and first bytes; a list that does not fit is refused.

    Args:
        path: a pickle (stream or list), `.npz` or `.pt` file.
        trust: allow any global in a pickle (and `weights_only=False` for `.pt`): only for your own files.
        available_ram: the RAM a pickled list may use (default: psutil's available memory).

    Raises:
        InputError (missing, another kind of file), BudgetExceeded (a pickled list larger than the RAM).
    """
    path = Path(path).absolute()  # the manifest's path must lead back to it from any folder (repair)
    if not path.is_file():
        raise InputError(f"--records {path} {'is a folder' if path.exists() else 'does not exist'}; pass "
                         f"a pickle stream, a pickled list, an .npz or a .pt file of records")
    size = path.stat().st_size
    if path.suffix == ".npz":
        return RecordSource("npz", str(path), size, trust)
    if path.suffix in (".pt", ".pth"):
        return RecordSource("pt", str(path), size, trust)
    kind = pickle_kind(path)
    if kind == "list":
        check_list_fits(path, size, available_ram)
        return RecordSource("pickle-list", str(path), size, trust)
    return RecordSource("pickle-stream", str(path), size, trust)


def pickle_kind(path: Path) -> str:
    """"list" when the file's first pickle is a list or tuple, "stream" when a dict; read from its opcodes."""
    with open(path, "rb") as f:
        try:
            ops = pickletools.genops(f)
            names = []
            for opcode, _arg, _pos in ops:
                if opcode.name in ("PROTO", "FRAME"):
                    continue
                names.append(opcode.name)
                if opcode.name != "MARK" or len(names) > 1:
                    break
        except ValueError as exc:
            raise InputError(f"--records {path} is not a pickle ({exc}); pass a pickle stream, a pickled "
                             f"list, an .npz or a .pt file of records") from None
    if not names:
        raise InputError(f"--records {path} is empty: it holds no records")
    first = names[-1]
    if first in ("EMPTY_LIST", "LIST", "EMPTY_TUPLE", "TUPLE"):
        return "list"
    if first in ("EMPTY_DICT", "DICT"):
        return "stream"
    raise InputError(f"--records {path}: its first pickled object starts with {first}, not a dict or a "
                     f"list of dicts; write each record as a dict (pickle.dump(record, f) in a loop)")


def check_list_fits(path: Path, size: int, available_ram: int | None) -> None:
    """BudgetExceeded with the numbers and the conversion to a stream, unless the whole list fits in RAM."""
    if available_ram is None:
        import psutil

        available_ram = int(psutil.virtual_memory().available)
    need = int(size * LIST_RAM_FACTOR)
    if need > available_ram:
        stream = path.with_name(path.stem + "-stream.pkl")
        raise BudgetExceeded(
            f"--records {path} is one pickled list of {fmt_bytes(size)}: it can only be unpickled whole, "
            f"which takes about {fmt_bytes(need)} ({LIST_RAM_FACTOR}x the file), and {fmt_bytes(available_ram)} "
            f"of RAM is available. Convert it once to a stream of records (on a machine where it fits): "
            f"{CONVERSION.format(path=path, stream=stream)}; then pass --records {stream}")


class AllowListUnpickler(pickle.Unpickler):
    """An Unpickler that resolves only numpy's globals and a few builtins (unless `trust`)."""

    def __init__(self, file, trust: bool = False):
        super().__init__(file)
        self.trust = trust

    def find_class(self, module: str, name: str):
        allowed = module == "numpy" or module.startswith(("numpy.", "numpy._core", "collections")) \
            or (module == "builtins" and name in SAFE_BUILTINS) or module == "_codecs" and name == "encode"
        if not (allowed or self.trust):
            raise InputError(f"the pickle names {module}.{name}, which record shards do not unpickle (a "
                             f"pickle can run any code it names); store numpy arrays and plain scalars, or "
                             f"pass trust=True (--trust-pickle) for a file you made yourself")
        return super().find_class(module, name)


# ====================================================================================== readers


def _pickle_stream(path: Path, trust: bool) -> Iterator[dict]:
    size = path.stat().st_size
    with open(path, "rb") as f:
        index = 0
        while f.tell() < size:
            at = f.tell()
            try:  # one unpickler per record: a stream's records never refer to each other
                record = AllowListUnpickler(f, trust).load()
            except (EOFError, pickle.UnpicklingError) as exc:
                raise InputError(f"--records {path}: record {index:,} (at byte {at:,} of {size:,}) is cut "
                                 f"short or damaged ({exc}); the stream ends early: rewrite it, or "
                                 f"truncate it to {at:,} bytes to keep the {index:,} records before") from None
            if isinstance(record, (list, tuple)):
                raise InputError(f"--records {path}: object {index:,} is a {type(record).__name__}, not one "
                                 f"record: write records with pickle.dump(record, f) one by one")
            yield record
            index += 1


def _pickle_list(path: Path, trust: bool) -> Iterator[dict]:
    with open(path, "rb") as f:
        records = list(AllowListUnpickler(f, trust).load())
    records.reverse()
    while records:
        yield records.pop()  # each record leaves the list as it is served: RAM falls as the shards fill


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

    try:
        loaded = torch.load(path, map_location="cpu", weights_only=not trust, mmap=_is_zip(path))
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
                         f"of dicts, or a dict of tensors with a leading record axis")
    yield from loaded


def _is_zip(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"PK\x03\x04"


def records_from_bytes(data: bytes) -> list:
    """The records of a pickle stream held in memory (tests, small inputs)."""
    f, out = io.BytesIO(data), []
    while f.tell() < len(data):
        out.append(AllowListUnpickler(f).load())
    return out
