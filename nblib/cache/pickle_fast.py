"""A pickled list of records at C speed: a C opcode scan, then CPython's own C unpickler fed a few elements at a time.

`fast_list_records(path)` reads a file holding one pickle whose top object is a list (what
`pickle.dump(records, f)` writes). `pickle_scan.c` (compiled on first use into the per-user folder)
walks its opcodes over a memory map, building nothing: where each element starts and ends, the last
op reading each memo slot, the frames, and the globals the file names. One `pickle.Unpickler` then
reads the elements, a chunk of about `CHUNK` bytes at a time, each chunk fed as a small pickle of
its own (`EMPTY_LIST MARK <the elements' ops> APPENDS STOP`, frames left out): the unpickler keeps
its memo between loads, so memo numbers stay those of the file, and slots no later op reads are
overwritten with None (`None LONG_BINPUT k ...`, which keeps the count MEMOIZE numbers from). RAM is
about one chunk of records plus the plan (24 bytes an element, 8 a memo slot).

Its `find_class` gives the allow-list of `nblib.cache.pickle_globals` wrapped so that the C unpickler's
BUILD reaches nothing real: numpy's two-step arrays and dtypes, and whatever an allowed function
makes that is not a plain builtin value, are `_Held` (BUILD gives an array or dtype its checked
state once, anything else is refused), allowed functions are `_Call`s (BUILD refused), and other
globals are the same `PickledObject` stand-ins. The records are then unwrapped (`_resolved`).

Anything else (another top object, a stream, an element reading its own list, a global outside
`FAST_GLOBALS`, no C compiler, any error) returns None or raises `NotFast`, and the pure-Python
reader reads the file, with the same records and the same one-line refusals. The trade-off: two
readers to keep equal, which tests/test_pickle_differential.py runs side by side over generated pickles.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import mmap
import os
import pickle
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from nblib.cache.pickle_globals import (
    ALLOWED,
    Pending,
    PickledObject,
    _Marker,
    allowed_global,
    array_from_state,
    refusal,
    short,
    stub_class,
)
from nblib.errors import ConfigError

CHUNK = 128 * 1024                 # bytes of elements fed to the unpickler at a time
READER_ENV = "NBLIB_PICKLE_READER"  # "pure": never this reader; "fast": this one wherever it plans the file
NOT_FAST = {("copyreg", "_reconstructor")}   # how protocols 0-1 write objects: the pure path reads those files
SOURCE = Path(__file__).with_name("pickle_scan.c")


class NotFast(Exception):
    """This reader does not read the file (or stopped): the pure-Python reader reads it from its first record."""


class _Plan(ctypes.Structure):
    _fields_ = [("end", ctypes.c_int64), ("status", ctypes.c_int), ("reason", ctypes.c_char * 96),
                ("protocol", ctypes.c_int), ("prefix_end", ctypes.c_int64), ("n_elems", ctypes.c_int64),
                ("starts", ctypes.POINTER(ctypes.c_int64)), ("ends", ctypes.POINTER(ctypes.c_int64)),
                ("slots_after", ctypes.POINTER(ctypes.c_int64)), ("n_slots", ctypes.c_int64),
                ("last_read", ctypes.POINTER(ctypes.c_int64)), ("n_frames", ctypes.c_int64),
                ("frames", ctypes.POINTER(ctypes.c_int64)), ("globals_len", ctypes.c_int64),
                ("globals", ctypes.c_void_p)]


def scanner() -> ctypes.CDLL:
    """The compiled scanner (built once into the per-user folder); ConfigError without a C compiler (tried once a
    process).
    """
    lib, error = _scanner()
    if error is not None:
        raise error
    return lib


@functools.lru_cache(maxsize=1)
def _scanner() -> tuple[ctypes.CDLL | None, ConfigError | None]:
    from nblib.budget.user_cache import compiled_library

    try:
        lib = ctypes.CDLL(str(compiled_library(SOURCE, "nblib-pickle-scan")))
    except ConfigError as exc:
        return None, exc
    lib.nblib_scan_list.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.POINTER(_Plan), ctypes.c_int]
    lib.nblib_plan_free.argtypes = [ctypes.POINTER(_Plan)]
    return lib, None


def reader_choice() -> str:
    """"pure", "fast" or "auto", from $NBLIB_PICKLE_READER (tests run both readers through it)."""
    choice = os.environ.get(READER_ENV, "auto").strip().lower()
    if choice not in ("pure", "fast", "auto"):
        raise ConfigError(f"{READER_ENV}={choice!r}: use pure, fast or auto")
    return choice


class ListPlan:
    """The C scan of a file of one pickled list: element byte ranges, memo slots' last reads, frames, globals."""

    def __init__(self, plan: _Plan):
        def array(pointer, n):             # copied: the scanner's arrays are freed right after
            return np.ctypeslib.as_array(pointer, (n,)).copy() if n else np.zeros(0, np.int64)

        self.end, self.protocol, self.prefix_end = plan.end, plan.protocol, plan.prefix_end
        self.starts, self.ends = array(plan.starts, plan.n_elems), array(plan.ends, plan.n_elems)
        self.slots_after = array(plan.slots_after, plan.n_elems)
        self.last_read, self.frames = array(plan.last_read, plan.n_slots), array(plan.frames, plan.n_frames)
        text = ctypes.string_at(plan.globals, plan.globals_len) if plan.globals_len else b""
        self.globals = [tuple(line.decode("utf-8", "replace").split(" ")) for line in text.splitlines()]


def scan_list(data) -> tuple[ListPlan | None, str]:
    """The C scan of the pickle at the start of `data` (bytes, or a file's mmap, whose pages it reads are handed
    back to the page cache as it goes): (its plan, "") or (None, why not).
    """
    view = np.frombuffer(data, np.uint8)
    if not view.size:
        return None, "an empty file"
    lib, plan = scanner(), _Plan()
    try:
        if lib.nblib_scan_list(view.ctypes.data, view.size, ctypes.byref(plan), isinstance(data, mmap.mmap)):
            return None, plan.reason.decode("ascii", "replace")
        return ListPlan(plan), ""
    finally:
        lib.nblib_plan_free(ctypes.byref(plan))


def fast_list_records(path: Path) -> Iterator[list] | None:
    """The elements of the file's pickled list, a chunk (a list) at a time, or None where this reader does not read
    the file.

    The iterator raises NotFast (or a data error) where it stops; the caller then reads the file the pure way.
    """
    choice = reader_choice()
    if choice == "pure":
        return None
    try:
        scanner()
    except ConfigError:
        if choice == "fast":
            raise
        return None
    size = path.stat().st_size
    if not size:
        return None
    with open(path, "rb") as f:
        try:
            data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)     # keeps its own descriptor
        except (OSError, ValueError):
            return None
    plan, _why = scan_list(data)
    if plan is None or plan.end != size or not all(_fast_global(*name, plan.protocol) for name in plan.globals):
        data.close()
        return None
    return _elements(data, plan)


def _elements(data: mmap.mmap, plan: ListPlan) -> Iterator:
    feed = _Feed()
    unpickler = _Unpickler(feed, plan.protocol)
    try:
        yield from _read_chunks(data, plan, feed, unpickler)
    finally:
        feed.fill([])
        del unpickler, feed
        with contextlib.suppress(BufferError):   # a view still held (by a traceback): the map closes when it goes
            data.close()


def _read_chunks(data: mmap.mmap, plan: ListPlan, feed: _Feed, unpickler: _Unpickler) -> Iterator[list]:
    feed.fill([*_unframed(data, plan.frames, 0, plan.prefix_end), b"."])
    if type(unpickler.load()) is not list:
        raise NotFast("the top object is not a list")
    pending, written, released = np.zeros(0, np.int64), 0, 0
    for i, j in _chunks(plan):
        feed.fill([b"](", *_elements_views(data, plan, i, j), b"e."])
        elements = _load(unpickler)
        feed.fill([b""])
        fed, now = int(plan.ends[j - 1]), int(plan.slots_after[j - 1])
        upto = fed // mmap.PAGESIZE * mmap.PAGESIZE
        if upto > released:                 # the file's pages read (and their neighbours the kernel mapped
            start = max(0, released - 2**20)  # with them, behind too): back to the page cache, out of RSS
            data.madvise(mmap.MADV_DONTNEED, start, upto - start)
            released = upto
        yield [_resolved_record(element) for element in elements]
        del elements
        candidates = np.concatenate([pending, np.arange(written, now, dtype=np.int64)])
        dead = plan.last_read[candidates] < fed
        pending, written = candidates[~dead], now
        if dead.any():                      # slots no later op reads: None in their place, the count kept
            feed.fill([_overwrite(candidates[dead])])
            unpickler.load()


def _load(unpickler: _Unpickler):
    """One chunk's elements, the cyclic garbage collector paused meanwhile: it would walk every new object of the
    chunk, none of them garbage yet (a cycle among them is collected once it resumes).
    """
    if not gc.isenabled():
        return unpickler.load()
    gc.disable()
    try:
        return unpickler.load()
    finally:
        gc.enable()


def _chunks(plan: ListPlan) -> Iterator[tuple[int, int]]:
    """Element index ranges of about CHUNK bytes each (at least one element)."""
    n = len(plan.starts)
    if not n:
        return
    cum = np.cumsum(plan.ends - plan.starts)
    cuts = np.searchsorted(cum, np.arange(CHUNK, int(cum[-1]), CHUNK), side="right") + 1
    bounds = np.unique(np.clip(np.concatenate([[0], cuts, [n]]), 0, n))
    yield from zip(bounds[:-1].tolist(), bounds[1:].tolist())


def _elements_views(data: mmap.mmap, plan: ListPlan, i: int, j: int) -> list[memoryview]:
    """The ops of elements i..j-1, in order, as views of the map, without what lies between batches (MARK,
    APPENDS) nor frames.
    """
    starts, ends = plan.starts[i:j], plan.ends[i:j]
    breaks = np.flatnonzero(ends[:-1] != starts[1:]) + 1
    firsts, lasts = np.concatenate([[0], breaks]), np.concatenate([breaks, [j - i]]) - 1
    return [view for a, b in zip(firsts.tolist(), lasts.tolist())
            for view in _unframed(data, plan.frames, int(starts[a]), int(ends[b]))]


def _unframed(data: mmap.mmap, frames: np.ndarray, start: int, end: int) -> list[memoryview]:
    """data[start:end] without the 9-byte FRAME ops inside it, as views."""
    whole = memoryview(data)
    inside = frames[np.searchsorted(frames, start):np.searchsorted(frames, end)]
    views, at = [], start
    for frame in inside.tolist():
        views.append(whole[at:frame])
        at = frame + 9
    views.append(whole[at:end])
    return views


def _overwrite(slots: np.ndarray) -> bytes:
    """A pickle that puts None in each memo slot of `slots` (LONG_BINPUT: the unpickler's slot count unchanged)."""
    if int(slots.max()) >= 2**32:
        raise NotFast("a memo slot past LONG_BINPUT's 4 bytes")
    ops = np.empty((len(slots), 5), np.uint8)
    ops[:, 0] = ord("r")
    ops[:, 1:] = slots.astype("<u4").view(np.uint8).reshape(-1, 4)
    return b"N" + ops.tobytes() + b"."


class _Feed:
    """The unpickler's file: one pickle in the parts it is filled with (bytes, or views of the map). `peek` hands it
    the rest of a part at once, so it calls Python about once a part; a large string is read or copied (`readinto`)
    straight from the map into the object the unpickler makes.
    """

    def __init__(self):
        self.fill([])

    def fill(self, parts: list) -> None:
        self._parts, self._part, self._at = [memoryview(p) for p in parts], 0, 0

    def peek(self, n: int = 0):
        while self._part < len(self._parts) and self._at >= len(self._parts[self._part]):
            self._part, self._at = self._part + 1, 0
        return self._parts[self._part][self._at:] if self._part < len(self._parts) else b""

    def read(self, n: int = -1):
        n = sum(len(p) for p in self._parts) if n is None or n < 0 else n
        out = []
        while n > 0:
            rest = self.peek()
            if not rest:
                break
            out.append(rest[:n])
            self._at += len(out[-1])
            n -= len(out[-1])
        return out[0] if len(out) == 1 else b"".join(out)

    def readinto(self, buffer) -> int:
        data = self.read(len(buffer))
        memoryview(buffer).cast("B")[:len(data)] = data
        return len(data)

    def readline(self):
        rest = bytes(self.peek())
        at = rest.find(b"\n")
        return self.read(len(rest) if at < 0 else at + 1)


class _Unpickler(pickle.Unpickler):
    """CPython's C unpickler, its globals through `_fast_global`."""

    def __init__(self, feed: _Feed, protocol: int):
        super().__init__(feed)
        self.protocol = protocol

    def find_class(self, module: str, name: str):
        found = _fast_global(module, name, self.protocol)
        if found is None:
            raise NotFast(f"{module}.{name}")
        return found


# ====================================================================================== stand-ins BUILD cannot reach


class _Held:
    """A value an allowed function made, or an array / dtype before its BUILD: a record holds its `value`."""

    __slots__ = ("value", "pending")

    def __init__(self, value=None, pending: Pending | None = None):
        self.value, self.pending = value, pending

    def __setstate__(self, state):
        pending = self.pending
        if pending is None:
            raise refusal(f"the state of {short(type(self.value).__name__)} (BUILD: only objects the file made are "
                          f"given their state)", does="sets")
        self.pending = None
        if pending is _ARRAY and type(state) is tuple and len(state) == 5 and type(state[2]) is _Held \
                and state[2].pending is None:     # numpy's (1, shape, dtype, fortran, bytes), its dtype held
            self.value = array_from_state((state[0], state[1], state[2].value, state[3], state[4]))
        else:
            self.value = pending.build(_plain(state))


class _Call:
    """An allowed function or type: called with plain arguments; what it makes is held unless a plain value."""

    __slots__ = ("call",)

    def __init__(self, call):
        self.call = call

    def __call__(self, *args):
        value = self.call(*[_plain(a) for a in args])
        if type(value) in _PLAIN:
            return value
        return _Held(pending=value) if isinstance(value, Pending) else _Held(value)

    def __setstate__(self, state):
        raise refusal(f"state for {short(getattr(self.call, '__qualname__', self.call))} (BUILD)", does="sets")


class _Reconstruct(_Call):
    """numpy's `_reconstruct(ndarray, (0,), b'b')`: the empty array its BUILD fills, held."""

    __slots__ = ()

    def __call__(self, subtype, shape, dtype):
        if subtype is _NDARRAY and shape == (0,):
            held = _new_held(_Held)         # no __init__: the commonest object of a record file, made in C
            held.pending = _ARRAY
            return held
        return _Call.__call__(self, subtype, shape, dtype)      # the pure path's refusal


_PLAIN = frozenset({int, float, complex, str, bytes, bytearray, bool, type(None), tuple, list, dict, set, frozenset,
                    slice, range, object})
_ATOMS = frozenset({int, float, complex, str, bytes, bool, type(None)})
_NDARRAY = ALLOWED[("numpy", "ndarray")]
_ARRAY = Pending(array_from_state)
_IN_PROGRESS = object()
_new_held = object.__new__


@functools.lru_cache(maxsize=4096)
def _fast_global(module: str, name: str, protocol: int):
    """What find_class gives for `module.name` here, or None where the pure path reads such files."""
    module, name, allowed = allowed_global(module, name, protocol)
    if (module, name) in NOT_FAST:
        return None
    if allowed is None:
        return stub_class(module, name)
    if isinstance(allowed, _Marker):
        return allowed
    if name == "_reconstruct":
        return _Reconstruct(allowed)
    return _Call(allowed)


def _plain(value):
    """An argument or state as the pure path's stand-ins receive it: held values and wrapped functions unwrapped."""
    t = type(value)
    if t in _ATOMS:
        return value
    if t is _Held:
        if value.pending is not None:
            raise NotFast("an array or dtype used before its BUILD")
        return value.value
    if t is _Call or t is _Reconstruct:
        return value.call
    if t is tuple:
        return tuple([_plain(v) for v in value])
    if t is list:
        return [_plain(v) for v in value]
    if t is dict:
        return {_plain(k): _plain(v) for k, v in value.items()}
    return value


def _resolved_record(element):
    """`_resolved` of one element: a dict of plain and held values (the commonest record) without a call a value."""
    if type(element) is not dict:
        return _resolved(element, {})
    for k, v in element.items():
        tv = type(v)
        if type(k) not in _ATOMS:
            return _resolved(element, {})
        if tv is _Held and v.pending is None:
            element[k] = v.value
        elif tv not in _ATOMS:
            return _resolved(element, {})
    return element


def _resolved(value, seen: dict):
    """`value` with every held value and wrapped function replaced by what the pure path holds there (in place in
    lists, dicts and objects; tuples and sets rebuilt where they change).
    """
    t = type(value)
    if t in _ATOMS:
        return value
    if t is _Held:
        if value.pending is not None:
            raise NotFast("an array or dtype never given its state")
        return value.value
    if t is _Call or t is _Reconstruct:
        return value.call
    key = id(value)
    if key in seen:
        if seen[key] is _IN_PROGRESS:
            raise NotFast("a tuple that holds itself")
        return seen[key]
    if t is dict:                      # the commonest record: its values resolved in place
        seen[key] = value
        for k, v in value.items():
            if type(k) not in _ATOMS:     # a key that is held (a numpy scalar...): the dict rebuilt in order
                items = [(_resolved(k, seen), _resolved(v, seen)) for k, v in value.items()]
                value.clear()
                value.update(items)
                break
            tv = type(v)
            if tv is _Held and v.pending is None:
                value[k] = v.value
            elif tv not in _ATOMS:
                value[k] = _resolved(v, seen)
        return value
    if t is list:
        seen[key] = value
        for i, v in enumerate(value):
            if type(v) not in _ATOMS:
                value[i] = _resolved(v, seen)
        return value
    if t in (tuple, set, frozenset):
        seen[key] = _IN_PROGRESS
        items = [_resolved(v, seen) for v in value]
        if t is set:
            value.clear()
            value.update(items)
        elif t is frozenset or any(a is not b for a, b in zip(items, value)):
            value = t(items)
        seen[key] = value
        return value
    if isinstance(value, PickledObject):
        seen[key] = value
        fields = value.__dict__
        for name in ("_args", "_state", "_items", "_list"):
            fields[name] = _resolved(fields[name], seen)
        return value
    return value
