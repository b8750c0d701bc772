"""What a record pickle may name: an exact allow-list that rebuilds arrays and tensors, and objects read as state.

Unpickling calls whatever global the file names (`os.system`, an `eval`, any importable function),
so a record pickle is read with `ALLOWED`, an exact map from (module, name) to what runs instead:

- numpy's own reconstruction (`_reconstruct`, `_frombuffer`, `scalar`, `ndarray`, `dtype`, and
  `ml_dtypes.bfloat16` for bf16 arrays), each checked to build plain arrays only;
- torch's `weights_only` globals for dense tensors (`torch._utils._rebuild_tensor_v2` and
  `_rebuild_parameter`, `torch._tensor._rebuild_from_type_v2`, `torch.Size`, `torch.device`,
  `collections.OrderedDict`/`Counter`, the `torch.*Storage` types), reimplemented to give numpy
  arrays; plus `torch.storage._load_from_bytes`, the storage of a tensor that plain `pickle.dump`
  wrote, which torch loads with `weights_only=False`: here its bytes are parsed, and its inner pickle
  may name a storage type only. torch is never imported; bf16 comes back as `ml_dtypes.bfloat16`;
- a few builtin types (`set`, `frozenset`, `complex`, `bytes`, `bytearray`, `slice`, `range`, `object`,
  `tuple`, `list`, `dict`),
  `_codecs.encode` (latin-1 only: how protocols 0-2 write bytes) and `copyreg._reconstructor`
  (how protocols 0-1 write objects), checked.

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
import pickle

import numpy as np

from nblib.errors import InputError

TORCH_MAGIC = 0x1950A86A20F9469CFC6C   # torch.serialization.MAGIC_NUMBER (the legacy format's first pickle)
TORCH_STORAGES = {"HalfStorage": "<f2", "FloatStorage": "<f4", "DoubleStorage": "<f8", "BFloat16Storage": "bfloat16",
                  "LongStorage": "<i8", "IntStorage": "<i4", "ShortStorage": "<i2", "CharStorage": "i1",
                  "ByteStorage": "u1", "BoolStorage": "?", "ComplexFloatStorage": "<c8",
                  "ComplexDoubleStorage": "<c16"}


def refusal(what: str) -> InputError:
    """The one-line refusal of a global outside the allow-list."""
    return InputError(f"the pickle calls {what}, which nblib does not run: a pickle runs every function it names, "
                      f"so records rebuild only numpy arrays and torch tensors (an exact allow-list) and read "
                      f"other objects from their pickled state; pass --trust-pickle (trust=True) only for a "
                      f"file you made yourself")


def bfloat16() -> np.dtype:
    """numpy's bf16 dtype (ml_dtypes'); InputError naming the install when ml_dtypes is missing."""
    try:
        import ml_dtypes
    except ImportError:
        raise InputError("these records hold bfloat16 tensors, which numpy holds through the ml_dtypes package: "
                         "pip install ml-dtypes") from None
    return np.dtype(ml_dtypes.bfloat16)


def storage_dtype(code: str) -> np.dtype:
    """The numpy dtype of a dtype code: a numpy `dtype.str`, or "bfloat16"."""
    return bfloat16() if code == "bfloat16" else np.dtype(code)


# ====================================================================================== objects as state


class _NotCallable(type):
    def __call__(cls, *args, **kwargs):  # REDUCE / INST / OBJ: running the class or function
        raise refusal(f"{cls.__module__}.{cls.__qualname__}(...)")


class PickledObject(metaclass=_NotCallable):
    """An object read from its pickle: its class (this one's name) was not imported and none of it ran."""

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


def _np_reconstruct(subtype, shape, dtype):
    if subtype is not np.ndarray:
        raise refusal(f"numpy's _reconstruct of {getattr(subtype, '__qualname__', subtype)!r} (only plain ndarrays)")
    return np.ndarray.__new__(np.ndarray, shape, dtype)


def _np_frombuffer(buffer, dtype, shape, order):
    if not isinstance(buffer, (bytes, bytearray)) or not isinstance(dtype, np.dtype) or dtype.hasobject:
        raise refusal("numpy's _frombuffer with other than bytes and a plain dtype")
    return np.frombuffer(buffer, dtype=dtype).reshape(shape, order=order)


def _np_scalar(dtype, data=None):
    if not isinstance(dtype, np.dtype) or dtype.hasobject or not isinstance(data, bytes):
        raise refusal("numpy's scalar of an object dtype")
    return np.frombuffer(data, dtype=dtype, count=1)[0]


def _np_dtype(obj, align=False, copy=False):
    if not isinstance(obj, (str, type)) or (isinstance(obj, type) and not issubclass(obj, np.generic)):
        raise refusal(f"numpy.dtype({obj!r})")
    return np.dtype(obj, align=align, copy=copy)


def _ml_bfloat16():
    return bfloat16().type


# ====================================================================================== torch, without torch


class _Marker:
    """A torch name the allow-list knows (a storage type, Tensor, Parameter): a value to check, never to call."""

    def __init__(self, name: str, dtype: str | None = None):
        self.name, self.dtype = name, dtype

    def __call__(self, *args, **kwargs):
        raise refusal(f"torch.{self.name}(...)")


class _StorageUnpickler(pickle.Unpickler):
    """The pickle inside `_load_from_bytes`: a persistent id naming a storage type; no other global."""

    def find_class(self, module, name):
        if module == "torch" and name in TORCH_STORAGES:
            return _Marker(name, TORCH_STORAGES[name])
        raise refusal(f"{module}.{name} inside a torch storage")

    def persistent_load(self, pid):
        return pid


def _load_from_bytes(data: bytes) -> np.ndarray:
    """A torch storage written by plain pickle (torch.save's legacy format), as a 1-d numpy array (a view)."""
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
    except (ValueError, TypeError, AttributeError, EOFError, pickle.UnpicklingError) as exc:
        raise InputError(f"a torch tensor's storage in the pickle is damaged ({exc}); rewrite the file") from None


def _rebuild_tensor(storage, offset, size, stride, *_rest):
    """torch._utils._rebuild_tensor_v2: the tensor's elements of its storage, as a numpy array (bounds checked)."""
    if not isinstance(storage, np.ndarray) or storage.ndim != 1:
        raise refusal("torch._utils._rebuild_tensor_v2 on something other than a storage")
    size, stride = tuple(int(s) for s in size), tuple(int(s) for s in stride)
    if offset < 0 or any(s < 0 for s in size + stride) or len(size) != len(stride):
        raise InputError(f"a torch tensor in the pickle has size {size}, stride {stride}, offset {offset}; rewrite it")
    if 0 in size:
        return np.zeros(size, dtype=storage.dtype)
    last = offset + sum((n - 1) * s for n, s in zip(size, stride))
    if last >= storage.size:
        raise InputError(f"a torch tensor in the pickle reaches element {last} of a storage of {storage.size}")
    view = np.lib.stride_tricks.as_strided(storage[offset:], size, [s * storage.itemsize for s in stride],
                                           writeable=False)
    return view if view.flags.c_contiguous else np.ascontiguousarray(view)


def _rebuild_parameter(data, _requires_grad=False, _hooks=None, _state=None):
    return data


def _rebuild_from_type(func, new_type, args, state):
    if func is not _rebuild_tensor or not (isinstance(new_type, _Marker) and new_type.name in ("Tensor", "Parameter")):
        raise refusal("torch._tensor._rebuild_from_type_v2 of a tensor subclass")
    return func(*args)


def _reconstructor(cls, base, state):
    """copyreg._reconstructor (protocols 0-1): an unknown class becomes a `PickledObject` holding `state`."""
    if not (isinstance(cls, type) and issubclass(cls, PickledObject)):
        return copyreg._reconstructor(cls, base, state)
    obj = cls.__new__(cls)
    if base in (tuple, list):
        obj._args = tuple(state)
    elif base is dict:
        obj._items.update(state)
    elif base is not object or state is not None:
        raise refusal(f"copyreg._reconstructor of {cls.__qualname__} on {getattr(base, '__name__', base)}")
    return obj


def _device(kind, index=None):
    return str(kind) if index is None else f"{kind}:{int(index)}"


def _codecs_encode(text, encoding="utf-8"):
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise refusal(f"_codecs.encode(..., {encoding!r})")
    return codecs.encode(text, encoding)


ALLOWED = {
    **{(module, "_reconstruct"): _np_reconstruct for module in ("numpy.core.multiarray", "numpy._core.multiarray")},
    **{(module, "scalar"): _np_scalar for module in ("numpy.core.multiarray", "numpy._core.multiarray")},
    **{(module, "_frombuffer"): _np_frombuffer for module in ("numpy.core.numeric", "numpy._core.numeric")},
    ("numpy", "ndarray"): np.ndarray, ("numpy", "dtype"): _np_dtype,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor, ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type,
    ("torch.storage", "_load_from_bytes"): _load_from_bytes,
    ("torch", "Size"): tuple, ("torch", "device"): _device, ("torch", "Tensor"): _Marker("Tensor"),
    ("torch.nn.parameter", "Parameter"): _Marker("Parameter"),
    **{("torch", name): _Marker(name, dtype) for name, dtype in TORCH_STORAGES.items()},
    ("collections", "OrderedDict"): collections.OrderedDict, ("collections", "Counter"): collections.Counter,
    **{("builtins", t.__name__): t for t in (set, frozenset, complex, bytes, bytearray, slice, range, object, tuple,
                                                                 list, dict)},
    ("_codecs", "encode"): _codecs_encode, ("copyreg", "_reconstructor"): _reconstructor,
}


def allowed_global(module: str, name: str):
    """What runs for the global `module.name`: its allow-listed stand-in, or None."""
    if (module, name) == ("ml_dtypes", "bfloat16"):
        return _ml_bfloat16()
    return ALLOWED.get((module, name))
