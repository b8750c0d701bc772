"""What a record pickle may name: an exact allow-list that rebuilds arrays and tensors, and objects read as state.

Unpickling calls whatever global the file names (`os.system`, an `eval`, any importable function),
so a record pickle is read with `ALLOWED`, an exact map from (module, name) to what runs instead:
numpy's own array and dtype reconstruction, torch's `weights_only` globals for dense tensors
(reimplemented to give numpy arrays, torch never imported), a few builtin types, `_codecs.encode`
and `copyreg._reconstructor`, each checked (the list: docs/formats.md, "Pickle safety").

Any other global (a dataclass, a namedtuple, your `Trace`) becomes a `PickledObject` subclass of that
name: creating it (NEWOBJ) records the arguments, BUILD records the state, and calling it (REDUCE:
running a function) raises `InputError` naming it. So records of any class are read from their
pickled state without importing the class, and nothing outside the list runs. `record_fields`
turns a record (dict, `PickledObject`, or with `trust`, a real dataclass, namedtuple or object)
into its fields.
"""
from __future__ import annotations

import codecs
import collections
import copyreg
import dataclasses
import functools
import io
import math
import pickle
import reprlib
from _compat_pickle import IMPORT_MAPPING, NAME_MAPPING

import numpy as np

from nblib.errors import InputError, one_line

_REPR = reprlib.Repr()   # Python 3.11's takes no arguments
_REPR.maxlevel, _REPR.maxtuple, _REPR.maxlist, _REPR.maxdict, _REPR.maxstring, _REPR.maxother = 2, 4, 4, 4, 60, 60
TORCH_MAGIC = 0x1950A86A20F9469CFC6C   # torch.serialization.MAGIC_NUMBER (the legacy format's first pickle)
TORCH_STORAGES = {"HalfStorage": "<f2", "FloatStorage": "<f4", "DoubleStorage": "<f8", "BFloat16Storage": "bfloat16",
                  "LongStorage": "<i8", "IntStorage": "<i4", "ShortStorage": "<i2", "CharStorage": "i1",
                  "ByteStorage": "u1", "BoolStorage": "?", "ComplexFloatStorage": "<c8",
                  "ComplexDoubleStorage": "<c16"}


def refusal(what: str, does: str = "calls") -> InputError:
    """The one-line refusal of what a pickle `does` outside the allow-list (`what` cut to about 100 characters)."""
    return InputError(f"the pickle {does} {short(what)}, which nblib does not run: a pickle runs every function it "
                      f"names, so records rebuild only numpy arrays and torch tensors (an exact allow-list) and "
                      f"read other objects from their pickled state; pass --trust-pickle (trust=True) only for a "
                      f"file you made yourself")


def short(text, limit: int = 100) -> str:
    """`text` (or its repr) cut to `limit` characters: a refusal never prints a whole record."""
    return one_line(text if isinstance(text, str) else _REPR.repr(text), limit)


def bfloat16() -> np.dtype:
    """numpy's bf16 dtype (ml_dtypes'); InputError naming the install when ml_dtypes is missing."""
    try:
        import ml_dtypes
    except ImportError:
        raise InputError("these records hold bfloat16 tensors, which numpy holds through the ml_dtypes package: "
                         "pip install ml-dtypes") from None
    return np.dtype(ml_dtypes.bfloat16)


def storage_dtype(code: str) -> np.dtype:
    """The numpy dtype of a dtype code: a numpy `dtype.str`, "bfloat16", or "ml_dtypes.NAME" (float8, int4...)."""
    if code == "bfloat16":
        return bfloat16()
    if code.startswith("ml_dtypes."):
        bfloat16()                                   # the install hint when ml_dtypes is missing
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, code.split(".", 1)[1]))
    return np.dtype(code)


# ====================================================================================== objects as state


class _NotCallable(type):
    def __call__(cls, *args, **kwargs):  # REDUCE / INST / OBJ: running the class or function
        raise refusal(f"{cls.__module__}.{cls.__qualname__}(...)")


class PickledObject(metaclass=_NotCallable):
    """An object read from its pickle: its class (this one's name) was not imported and none of it ran.

    Unhashable: its class's `__hash__` did not run, so it cannot stand for the object as a dict key or a set
    member (a TypeError, then one line naming the record).
    """

    __hash__ = None

    def __new__(cls, *args, **kwargs):  # NEWOBJ: cls.__new__(cls, *args)
        self = object.__new__(cls)
        self.__dict__.update(_args=args, _state=None, _items={}, _list=[])
        return self

    def __setstate__(self, state):      # BUILD
        self.__dict__["_state"] = state

    def __setitem__(self, key, value):  # SETITEM(S) of a dict subclass
        self._items[key] = value

    def append(self, value):            # APPEND(S) of a list subclass
        self._list.append(value)

    def extend(self, values):
        self._list.extend(values)

    def fields(self) -> dict:
        """Its fields by name from the state (dict, or (dict, slots)); values without names by position."""
        state, out = self._state, {}
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict) \
                and (state[0] is None or isinstance(state[0], dict)):
            out.update(state[0] or {})
            out.update(state[1])
        elif isinstance(state, dict):
            out.update(state)
        elif isinstance(state, (list, tuple)):  # a frozen dataclass with slots: its values in field order
            out.update({str(i): v for i, v in enumerate(state)})
        elif state is not None:
            out["state"] = state
        out.update(self._items)
        if not out:  # a namedtuple: NEWOBJ's arguments are its values
            out.update({str(i): v for i, v in enumerate(self._list or self._args)})
        return out

    def __repr__(self) -> str:
        return f"<pickled {type(self).__module__}.{type(self).__qualname__}>"


@functools.lru_cache(maxsize=1024)
def stub_class(module: str, name: str) -> type:
    """The `PickledObject` subclass standing for `module.name` (one per name)."""
    return _NotCallable(name, (PickledObject,), {"__module__": module, "__qualname__": name})


def record_fields(obj):
    """A record as a dict of fields: dicts as they are, objects from their state; anything else unchanged."""
    if isinstance(obj, dict):
        return obj
    if isinstance(obj, PickledObject):
        return obj.fields()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return dict(zip(obj._fields, obj))
    if isinstance(obj, (list, tuple, np.ndarray)) or hasattr(obj, "detach"):
        return obj
    fields = dict(getattr(obj, "__dict__", {}))
    for cls in type(obj).__mro__:
        slots = getattr(cls, "__slots__", ())
        for slot in [slots] if isinstance(slots, str) else slots:
            if slot not in ("__dict__", "__weakref__") and hasattr(obj, slot):
                fields[slot] = getattr(obj, slot)
    return fields or obj


def is_record(obj) -> bool:
    """Whether `obj` is a record (a dict or an object of fields), not a field value (array, tensor, scalar)."""
    return isinstance(obj, (dict, PickledObject)) or (dataclasses.is_dataclass(obj) and not isinstance(obj, type)) \
        or hasattr(obj, "_fields") or (hasattr(obj, "__dict__") and not hasattr(obj, "detach")
                                       and not isinstance(obj, (np.ndarray, np.generic, type)))


# ====================================================================================== numpy

EXPANDED_SLACK = 64 * 2**20   # a tensor view may hold this many bytes more than its storage (a small broadcast)


def _np_reconstruct(subtype, shape, dtype):
    """numpy's `_reconstruct(ndarray, (0,), b'b')`: the empty array a BUILD then fills (`array_from_state`)."""
    if subtype is not _NDARRAY or tuple(shape) != (0,):
        raise refusal(f"numpy's _reconstruct of {short(subtype)} with shape {short(shape)} (only numpy's own "
                      f"_reconstruct(ndarray, (0,), ...))")
    return Pending(array_from_state)


def array_from_state(state) -> np.ndarray:
    """numpy's ndarray BUILD state `(1, shape, dtype, is_fortran, bytes)`, checked, as an array (no setstate): a
    read-only view of the state's bytes, as torch tensors' storages are.
    """
    if isinstance(state, tuple) and len(state) == 4:
        state = (1, *state)
    if not (isinstance(state, tuple) and len(state) == 5):
        raise refusal(f"numpy's ndarray state {short(state)}", does="holds")
    version, shape, dtype, fortran, data = state
    if not (version == 1 and isinstance(shape, tuple) and (
            (len(shape) == 1 and type(shape[0]) is int and shape[0] >= 0) or all(map(_is_size, shape)))
            and isinstance(dtype, np.dtype) and isinstance(fortran, bool) and isinstance(data, (bytes, bytearray))):
        raise refusal(f"numpy's ndarray state {short(state)}", does="holds")
    global _LAST_DTYPE
    last = _LAST_DTYPE                    # what is asked of a dtype, once for a run of arrays of the same one (one
    if last[0] is not dtype:              # tuple, read once: threads building arrays never mix two dtypes' answers)
        last = _LAST_DTYPE = (dtype, dtype.hasobject, dtype.itemsize, not dtype.isnative and dtype.byteorder in "<>")
    _, hasobject, itemsize, swapped = last
    if hasobject:
        raise refusal(f"an object array ({dtype})", does="holds")
    count = math.prod(shape)              # exact (Python ints): sizes are compared before anything is made
    if count * itemsize != len(data):
        raise InputError(f"an array in the pickle has shape {short(shape)} of {dtype} ({count * itemsize:,} "
                         f"bytes) and {len(data):,} bytes of data; the file is damaged")
    flat = np.frombuffer(data, dtype=dtype, count=count) if itemsize else np.zeros(count, dtype)
    array = flat if len(shape) == 1 else flat.reshape(shape, order="F") if fortran else flat.reshape(shape)
    if swapped:                           # numpy's setstate swaps such arrays to native order
        return array.astype(dtype.newbyteorder("="), order="K")
    return array          # a read-only view of the bytes read: a record of gigabytes is not copied


_LAST_DTYPE: tuple = (None, False, 0, False)  # the last dtype an array was built of, and what was asked of it


def _is_size(n) -> bool:
    return type(n) is int and n >= 0


def _np_frombuffer(buffer, dtype, shape, order):
    if not isinstance(buffer, (bytes, bytearray)) or not isinstance(dtype, np.dtype) or dtype.hasobject:
        raise refusal("numpy's _frombuffer with other than bytes and a plain dtype")
    return np.frombuffer(buffer, dtype=dtype).reshape(shape, order=order)


def _np_scalar(dtype, data=None):
    if not isinstance(dtype, np.dtype) or dtype.hasobject or not isinstance(data, bytes):
        raise refusal("numpy's scalar of an object dtype")
    if dtype.itemsize == 0:                     # an empty string: np.array(['']) holds '<U1' elements, not '<U0'
        if data:
            raise InputError(f"a numpy scalar of {dtype} holds {len(data)} bytes; the file is damaged")
        return dtype.type()
    if len(data) != dtype.itemsize:
        raise InputError(f"a numpy scalar of {dtype} holds {len(data)} bytes, not {dtype.itemsize}; the file is "
                         f"damaged")
    return np.frombuffer(data, dtype=dtype, count=1)[0]


def _np_dtype(obj, align=False, copy=False):
    """numpy.dtype(code) as numpy's pickles call it: a code string or a numpy scalar type; BUILD comes next."""
    if not isinstance(obj, (str, type)) or (isinstance(obj, type) and not issubclass(obj, np.generic)):
        raise refusal(f"numpy.dtype({short(obj)})")
    if not isinstance(align, bool) or not isinstance(copy, bool):
        raise refusal(f"numpy.dtype({short(obj)}, {short(align)}, {short(copy)})")
    try:
        return Pending(dtype_from_state, np.dtype(obj, align=align))
    except TypeError as exc:
        raise InputError(f"numpy.dtype({short(obj)}) in the pickle: {exc}") from None


def dtype_from_state(base: np.dtype, state) -> np.dtype:
    """numpy's dtype BUILD state, checked, as a new dtype built by numpy's public constructors.

    numpy writes `(version, byteorder, subarray, names, fields, elsize, alignment, flags[, metadata])`;
    handing a malformed one to `dtype.__setstate__` can crash the process, so the dtype is rebuilt from
    the descriptor and must come out with the elsize, alignment and flags the state claims.
    """
    if not (isinstance(state, tuple) and len(state) in (8, 9) and state[0] in (3, 4) and state[1] in "<>|="
            and len(state[1]) == 1 and all(type(v) is int for v in state[5:8])):
        raise refusal(f"numpy's dtype state {short(state)}", does="holds")
    _, order, subarray, names, fields, elsize, alignment, flags = state[:8]
    try:
        if subarray is not None:
            sub, shape = subarray
            if not isinstance(sub, np.dtype) or not isinstance(shape, tuple):
                raise TypeError("a subarray is (dtype, shape)")
            dtype = np.dtype((sub, shape))
        elif names is not None or fields is not None:
            dtype = _structured(names, fields, elsize, bool(flags & 0x80))
        else:
            dtype = _with_unit(base, state[8] if len(state) == 9 else None)
            if order in "<>" and dtype.byteorder != "|":
                dtype = dtype.newbyteorder(order)
    except (TypeError, ValueError, KeyError) as exc:
        raise refusal(f"numpy's dtype state {short(state)} ({short(str(exc))})", does="holds") from None
    if (elsize not in (-1, dtype.itemsize) or alignment not in (-1, dtype.alignment) or flags != dtype.flags):
        raise refusal(f"numpy's dtype state {short(state)} (it does not describe {dtype})", does="holds")
    return dtype


def _structured(names, fields, elsize: int, aligned: bool) -> np.dtype:
    if not (isinstance(names, tuple) and isinstance(fields, dict) and all(isinstance(n, str) for n in names)):
        raise TypeError("names are a tuple of str and fields a dict")
    spec = [fields[n] for n in names]
    if not all(isinstance(f, tuple) and len(f) in (2, 3) and isinstance(f[0], np.dtype) and type(f[1]) is int
               for f in spec):
        raise TypeError("each field is (dtype, offset[, title])")
    return np.dtype({"names": list(names), "formats": [f[0] for f in spec], "offsets": [f[1] for f in spec],
                     "titles": [f[2] if len(f) == 3 else None for f in spec], "itemsize": elsize}, align=aligned)


def _with_unit(base: np.dtype, metadata) -> np.dtype:
    """A datetime64 / timedelta64 dtype's unit from its state's metadata `(None, (unit, count, 1, 1))`."""
    if metadata is None:
        return base
    if base.kind not in "Mm" or not (isinstance(metadata, tuple) and len(metadata) == 2
                                     and isinstance(metadata[1], tuple) and len(metadata[1]) == 4):
        raise TypeError("only datetime64 and timedelta64 carry metadata")
    unit, count = metadata[1][:2]
    if not isinstance(unit, bytes) or type(count) is not int or count < 1:
        raise TypeError("a unit is (bytes, count)")
    unit = unit.decode("ascii")
    return np.dtype(f"{base.char}8[{count if count != 1 else ''}{unit}]")


class Pending:
    """An array or dtype that numpy's pickles make in two steps: REDUCE, then BUILD with its state.

    The unpickler builds the real value from the checked state (`array_from_state`,
    `dtype_from_state`) and puts it where the stand-in was (the stack, and the memo slots in `keys`).
    """

    __slots__ = ("make", "base", "keys")

    def __init__(self, make, base=None):
        self.make, self.base, self.keys = make, base, []

    def build(self, state):
        return self.make(state) if self.base is None else self.make(self.base, state)


# ====================================================================================== torch, without torch


class _Marker:
    """A name the allow-list knows (a storage type, Tensor, Parameter, numpy.ndarray): a value, never called."""

    __slots__ = ("name", "dtype")

    def __init__(self, name: str, dtype: str | None = None):
        self.name, self.dtype = name, dtype

    def __call__(self, *args, **kwargs):
        raise refusal(f"{self.name}(...)")

    def __setstate__(self, state):     # BUILD on a shared marker would change it for every later file
        raise refusal(f"state for {self.name} (BUILD)", does="sets")


_NDARRAY = _Marker("numpy.ndarray")
_STORAGES = {name: _Marker(f"torch.{name}", dtype) for name, dtype in TORCH_STORAGES.items()}


class _StorageUnpickler(pickle.Unpickler):
    """The pickle inside `_load_from_bytes`: a persistent id naming a storage type; no other global."""

    def find_class(self, module, name):
        if module == "torch" and name in TORCH_STORAGES:
            return _STORAGES[name]
        raise refusal(f"{module}.{name} inside a torch storage")

    def persistent_load(self, pid):
        return pid


def _load_from_bytes(data: bytes) -> np.ndarray:
    """A torch storage written by plain pickle (torch.save's legacy format), as a 1-d numpy array (a view)."""
    if not isinstance(data, bytes):
        raise refusal(f"torch.storage._load_from_bytes({short(data)})")
    f = io.BytesIO(data)
    try:
        magic, _version, info = (_StorageUnpickler(f).load() for _ in range(3))
        pid = _StorageUnpickler(f).load()
        keys = _StorageUnpickler(f).load()
        kind, storage_type, key, _location, numel = pid[:5]
        if magic != TORCH_MAGIC or kind != "storage" or keys != [key] or not info.get("little_endian", True):
            raise ValueError("not one little-endian storage")
        count = int.from_bytes(f.read(8), "little")
        dtype = storage_dtype(storage_type.dtype)
        if count != numel or f.tell() + count * dtype.itemsize > len(data):
            raise ValueError(f"{count} elements of {numel}")
        return np.frombuffer(data, dtype=dtype, count=count, offset=f.tell())
    except (ValueError, TypeError, AttributeError, EOFError, IndexError, KeyError, pickle.UnpicklingError) as exc:
        raise InputError(f"a torch tensor's storage in the pickle is damaged ({short(str(exc))}); rewrite the "
                         f"file") from None


def _rebuild_tensor(storage, offset, size, stride, *_rest):
    """torch._utils._rebuild_tensor_v2: the tensor's elements of its storage, as a numpy array (bounds checked).

    A view whose values take more bytes than its storage (a broadcast: `x.expand(...)`, stride 0)
    is refused past `EXPANDED_SLACK`: `pickle.load` keeps torch's view, a numpy copy would not.
    """
    if not isinstance(storage, np.ndarray) or storage.ndim != 1 or type(offset) is not int \
            or not isinstance(size, tuple) or not isinstance(stride, tuple) \
            or not all(type(s) is int for s in size + stride):
        raise refusal("torch._utils._rebuild_tensor_v2 on something other than a storage")
    if offset < 0 or any(s < 0 for s in size + stride) or len(size) != len(stride):
        raise InputError(f"a torch tensor in the pickle has size {short(size)}, stride {short(stride)}, offset "
                         f"{offset}; rewrite it")
    if 0 in size:
        return np.zeros(size, dtype=storage.dtype)
    last = offset + sum((n - 1) * s for n, s in zip(size, stride))
    if last >= storage.size:
        raise InputError(f"a torch tensor in the pickle reaches element {last:,} of a storage of {storage.size:,}")
    values = int(np.prod(size, dtype=np.int64)) * storage.itemsize
    if values > storage.nbytes + EXPANDED_SLACK:
        raise InputError(f"a torch tensor in the pickle is a view of {values:,} bytes over a storage of "
                         f"{storage.nbytes:,} (a broadcast such as expand(), stride {short(stride)}); save "
                         f"x.contiguous() (or x.clone()) instead of the view")
    view = np.lib.stride_tricks.as_strided(storage[offset:], size, [s * storage.itemsize for s in stride],
                                           writeable=False)
    return view if view.flags.c_contiguous else np.ascontiguousarray(view)


def _rebuild_parameter(data, _requires_grad=False, _hooks=None, _state=None):
    return data


def _rebuild_from_type(func, new_type, args, state):
    if func is not _rebuild_tensor or not (isinstance(new_type, _Marker)
                                           and new_type.name in ("torch.Tensor", "torch.nn.Parameter")):
        raise refusal("torch._tensor._rebuild_from_type_v2 of a tensor subclass")
    return func(*args)


def _reconstructor(cls, base, state):
    """copyreg._reconstructor (protocols 0-1): an unknown class becomes a `PickledObject` holding `state`."""
    if not (isinstance(cls, type) and issubclass(cls, PickledObject)):
        if any(cls is value for value in ALLOWED.values()):
            raise refusal(f"copyreg._reconstructor of {short(cls)}")
        return copyreg._reconstructor(cls, _REAL.get(base, base), state)   # trust=True: the file's own class
    obj = cls.__new__(cls)
    if base in (_BUILTIN[tuple], _BUILTIN[list]):
        obj._args = tuple(state)
    elif base is _BUILTIN[dict]:
        obj._items.update(state)
    elif base is not _BUILTIN[object] or state is not None:
        raise refusal(f"copyreg._reconstructor of {cls.__qualname__} on {short(getattr(base, '__name__', base))}")
    return obj


def _device(kind, index=None):
    return str(kind) if index is None else f"{kind}:{int(index)}"


def _codecs_encode(text, encoding="utf-8"):
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise refusal(f"_codecs.encode(..., {short(encoding)})")
    return codecs.encode(text, encoding)


def _built_from_data(make):
    """`make` (a builtin type, OrderedDict, Counter) over values the file holds, never a lazy `range` nor a
    count of bytes to allocate (`bytes(10**12)`): what a pickle's own REDUCE of such values passes.
    """

    def built(*args):
        if any(isinstance(a, range) or (make in (bytes, bytearray) and type(a) is int) for a in args):
            raise refusal(f"{make.__name__}({short(args)[1:-1]}) (a value the file would only ask for)")
        return make(*args)

    built.__name__ = built.__qualname__ = make.__name__
    return built


_BUILTIN = {t: _built_from_data(t) for t in (set, frozenset, complex, bytes, bytearray, slice, range, object,
                                               tuple, list, dict, collections.OrderedDict, collections.Counter)}
_REAL = {built: t for t, built in _BUILTIN.items()}
ALLOWED = {
    **{(module, "_reconstruct"): _np_reconstruct for module in ("numpy.core.multiarray", "numpy._core.multiarray")},
    **{(module, "scalar"): _np_scalar for module in ("numpy.core.multiarray", "numpy._core.multiarray")},
    **{(module, "_frombuffer"): _np_frombuffer for module in ("numpy.core.numeric", "numpy._core.numeric")},
    ("numpy", "ndarray"): _NDARRAY, ("numpy", "dtype"): _np_dtype,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor, ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type,
    ("torch.storage", "_load_from_bytes"): _load_from_bytes,
    ("torch", "Size"): _BUILTIN[tuple], ("torch", "device"): _device, ("torch", "Tensor"): _Marker("torch.Tensor"),
    ("torch.nn.parameter", "Parameter"): _Marker("torch.nn.Parameter"),
    **{("torch", name): marker for name, marker in _STORAGES.items()},
    ("collections", "OrderedDict"): _BUILTIN[collections.OrderedDict],
    ("collections", "Counter"): _BUILTIN[collections.Counter],
    **{("builtins", t.__name__): built for t, built in _BUILTIN.items() if t.__module__ == "builtins"},
    ("_codecs", "encode"): _codecs_encode, ("copyreg", "_reconstructor"): _reconstructor,
}
_RECORD_MAKERS = {("collections", "OrderedDict"), ("collections", "Counter"), ("copyreg", "_reconstructor"),
                  ("builtins", "dict")}


def allowed_global(module: str, name: str, protocol: int) -> tuple[str, str, object]:
    """The global `module.name` as Python 3 names it (protocols 0-2 may name Python 2's modules: pickle's own
    mapping), and what runs for it: its allow-listed stand-in, or None.
    """
    if protocol < 3:
        module, name = NAME_MAPPING.get((module, name), (IMPORT_MAPPING.get(module, module), name))
    allowed = bfloat16().type if (module, name) == ("ml_dtypes", "bfloat16") else ALLOWED.get((module, name))
    return module, name, allowed


@functools.lru_cache(maxsize=4096)
def global_kind(dotted: str | None) -> str:
    """"record" when an object made by the global `dotted` is a record (a class outside the allow-list, a
    dict-like), "value" for what the allow-list rebuilds (arrays, tensors, scalars, sets).
    """
    if dotted is None:
        return "value"
    module, _, name = dotted.rpartition(".")
    module, name, allowed = allowed_global(module, name, protocol=0)
    if (module, name) in _RECORD_MAKERS:
        return "record"
    return "value" if allowed is not None else "record"
