"""Any pickle of records, one record at a time: a stream of dumps, or one list, tuple or dict of any size.

`pickle_records(path)` yields the records of a file holding one or more pickles, read as
`pickle.Unpickler(f).load()` in a loop reads them, through the allow-list of
`nblib.cache.pickle_globals`. Each pickle is first scanned (`nblib.cache.pickle_scan`): its top
object, as STOP returns it, decides what its records are (the table of docs/formats.md, "Pickle safety"):
each element of a list, each value of a dict of records (its key kept in the field `key`), each record
of a tuple of records or of lists of records, row i of a file's only pickle `(X, y)` of equal-length
lists or arrays, and anything else (a dict of fields, an object) is one record.

Lists, dicts of records and tuples are not built whole: at each element's end the pure-Python
unpickler hands the element out and leaves None in its place, and memo slots no later op reads are
dropped, so RAM is about one record whatever the file's size. `(X, y)` files and single records are
built whole. What the file held is said in one line (`shape`).
"""
from __future__ import annotations

import pickle
import struct
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from nblib.cache.pickle_fast import NotFast, fast_list_records
from nblib.cache.pickle_globals import (
    Pending,
    PickledObject,
    allowed_global,
    is_record,
    record_fields,
    refusal,
    short,
    stub_class,
)
from nblib.cache.pickle_scan import OPS, RECORD, NotFresh, PicklePlan, PickleScanner
from nblib.errors import InputError

KEY_FIELD = "key"
DATA_ERRORS = (EOFError, pickle.UnpicklingError, ValueError, IndexError, KeyError, TypeError, AttributeError,
               MemoryError, RecursionError, OverflowError, struct.error, UnicodeDecodeError)


def pickle_records(path: Path, trust: bool = False, report: dict | None = None) -> Iterator[dict]:
    """The records of a file of pickles, one at a time (see the module's docstring); dicts of fields.

    `report`, when given, gets "shape": one line saying what the file held and how it was read.
    """
    path = Path(path)
    served = 0
    elements = None if trust else fast_list_records(path)
    if elements is not None:                  # one pickled list, planned by the C scan (nblib.cache.pickle_fast)
        try:
            for chunk in elements:
                for element in chunk:
                    for record in [element] if type(element) is dict else element_records(element):
                        yield record
                        served += 1
            if report is not None:
                report["shape"], report["reader"] = f"a list of records: {served:,} records", "fast"
            return
        except (NotFast, InputError, *DATA_ERRORS):
            pass                              # read again the pure way: the same records, and its one line
    reading = _FileReading(path, trust, continued=_one_pickler(path))
    try:
        for count, record in enumerate(reading.records()):
            if count >= served:
                yield record
                served += 1
    except _FreshFailed as failed:            # a later dump misread with a fresh memo: read on as one Pickler's
        reading = _FileReading(path, trust, continued=True)
        yield from _read_on(reading, served, failed.refusal)
    if report is not None:
        report["shape"], report["reader"] = reading.shape(), "pure"


def _one_pickler(path: Path) -> bool:
    """Whether one Pickler wrote the file's dumps (a dump reads a memo slot only an earlier one wrote): every
    pickle after the first is scanned before any record is served, so the whole file is read one way. At
    protocol 4+ (MEMOIZE numbers implicitly) one Pickler's stream may look fresh here: see `_read_on`.
    """
    size = path.stat().st_size
    with open(path, "rb") as f:
        scanner, at = PickleScanner(f, size), 0
        try:
            while at < size:
                at = scanner.scan(at).end
        except NotFresh:
            return True
        except (InputError, *DATA_ERRORS):
            pass                          # reported, with the records before it, when the file is read
    return False


class _FreshFailed(Exception):
    """A dump after the first does not read with a fresh memo (damaged, or refused by the allow-list): the file
    may be one Pickler's stream; `refusal` is what is said where it does not read continued either.
    """

    def __init__(self, refusal: InputError):
        super().__init__(str(refusal))
        self.refusal = refusal


def _read_on(reading: _FileReading, served: int, refusal: InputError) -> Iterator[dict]:
    """The records after the first `served` of a file whose later dump did not read with a fresh memo, read again
    as one Pickler's stream (`reading`, continued): only where each record served from a later dump reads the same
    that way (the first dump reads the same either way), else `refusal`, as where that reading fails too before a
    new record. The served records are read again fresh, one at a time, to be compared: nothing is kept meanwhile.
    """
    fresh, end = _FileReading(reading.path, reading.trust, continued=False), object()
    again, records = fresh.records(), reading.records()
    try:
        for _ in range(served):
            old, new = next(again), next(records)
            if fresh.pickles and not _same(old, new):
                raise refusal
        following = next(records, end)
    except (InputError, StopIteration, RecursionError):
        raise refusal from None
    finally:
        again.close()
    if following is not end:
        yield following
        yield from records


def _same(a, b, seen: set | None = None) -> bool:
    """Whether two readings of a value are the same: types, float bits, containers item by item (one met again
    inside itself paired as before), objects read from their state by it, anything else by its pickle; False
    where unsure.
    """
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, PickledObject):
        a, b = vars(a), vars(b)
    if isinstance(a, (dict, list, tuple)):
        seen = set() if seen is None else seen
        if (id(a), id(b)) in seen:
            return True
        seen.add((id(a), id(b)))
    if isinstance(a, dict):
        return len(a) == len(b) and all(_same(ka, kb, seen) and _same(va, vb, seen)
                                        for (ka, va), (kb, vb) in zip(a.items(), b.items()))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y, seen) for x, y in zip(a, b))
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    if isinstance(a, (int, str, bytes)):
        return a == b
    try:
        return pickle.dumps(a, protocol=5) == pickle.dumps(b, protocol=5)
    except Exception:       # noqa: BLE001 - whatever pickling a value raises: not known to be the same
        return False


class _FileReading:
    """One pass over a file's pickles: scan one, read it, hand out its records, then the next."""

    def __init__(self, path: Path, trust: bool, continued: bool):
        self.path, self.trust, self.continued = path, trust, continued
        self.shapes: Counter = Counter()
        self.pickles = self.records_read = 0

    def records(self) -> Iterator[dict]:
        path, size = self.path, self.path.stat().st_size
        with open(path, "rb") as f, open(path, "rb") as scan:
            scanner, reader = PickleScanner(scan, size, self.continued), _Reader(f, self.trust)
            at = 0
            while at < size:
                try:
                    plan = scanner.scan(at)
                    for record in self.pickle(reader, plan, size):
                        yield record
                        self.records_read += 1
                except InputError as refused:
                    if self.pickles > 0 and not self.continued:     # a later dump may be misread with a fresh memo
                        raise _FreshFailed(refused) from None
                    raise
                except DATA_ERRORS as exc:
                    later = self.pickles > 0 and not self.continued
                    refusal = _damaged(path, self.records_read, at, size, exc, later)
                    if later and not isinstance(exc, EOFError):   # cut short reads no better continued
                        raise _FreshFailed(refusal) from None
                    raise refusal from None
                at = plan.end
                self.pickles += 1

    def pickle(self, reader: _Reader, plan: PicklePlan, size: int) -> Iterator[dict]:
        """The records of one pickle, by its top object."""
        how, handouts = _serving(plan.top)
        if how is None:
            value = reader.whole(plan, self.continued)
            alone = plan.start == 0 and plan.end == size
            records, shape = top_records(value, alone)
            self.shapes[shape] += 1
            yield from records
            return
        self.shapes[how if how != "dict" else f"a dict of records (their keys in field '{KEY_FIELD}')"] += 1
        elements = reader.elements(plan, handouts, self.continued, keyed=how == "dict")
        if how == "dict":
            yield from keyed_records(elements, self.path)
        else:
            for element in elements:
                yield from element_records(element)

    def shape(self) -> str:
        """One line: what the file held and how many records it gave."""
        records = self.records_read
        kinds = ", ".join(f"{n:,} x {what}" if self.pickles > 1 else what for what, n in self.shapes.most_common(3))
        more = "" if len(self.shapes) <= 3 else f" and {len(self.shapes) - 3} other shapes"
        holds = f"{self.pickles:,} pickles ({kinds}{more})" if self.pickles != 1 else kinds
        return f"{holds}: {records:,} records"


def _serving(top) -> tuple[str | None, list | None]:
    """How a pickle's top object is served: its elements' end ops, or (None, None) to build it whole."""
    if top.self_read:
        return None, None
    if top.kind == "list" and top.ends is not None:
        return "a list of records", list(top.ends)
    if top.kind == "dict" and top.ends is not None and all(k == RECORD for k in top.kinds):
        return "dict", list(top.ends)
    children = top.children if top.kind == "tuple" else None
    if not children:
        return None, None
    items = [item for _, item in children]
    if all(item.code() == RECORD for item in items):
        return "a tuple of records", [end for end, _ in children]
    if all(item.kind == "list" and not item.self_read and item.ends is not None and all(k == RECORD for k in item.kinds)
           for item in items):
        return f"a tuple of {len(items)} lists of records", sorted(end for item in items for end in item.ends)
    return None, None


def keyed_records(pairs, path) -> Iterator[dict]:
    """The records of a dict of records, (key, record) pairs in order: each record's fields and its key, in the
    field `key` (`dict_key` when the first record has a field `key`); a key met twice is refused.
    """
    key_field, seen = None, set()
    for key, value in pairs:
        if key in seen:
            raise InputError(f"--records {path}: the pickled dict of records holds the key {short(key)} twice "
                             f"(pickle.load keeps the last); write each record once")
        seen.add(key)
        fields = dict(record_fields(value))
        key_field = key_field or (KEY_FIELD if KEY_FIELD not in fields else f"dict_{KEY_FIELD}")
        fields[key_field] = key
        yield fields


def element_records(element) -> list[dict]:
    """An element of a list: a record; a tuple or list of records, each; a tuple of values, one record."""
    if is_record(element):
        return [record_fields(element)]
    if isinstance(element, (list, tuple)) and element and all(is_record(e) for e in element):
        return [record_fields(e) for e in element]
    if isinstance(element, tuple) and not hasattr(element, "_fields"):
        return [dict(zip(positional_names(len(element)), element))]
    return [record_fields(element)]


def top_records(value, alone: bool) -> tuple[list, str]:
    """The records of a top object built whole, and its shape; `alone`: the file's only pickle."""
    if isinstance(value, list):
        return [r for e in value for r in element_records(e)], "a list of records"
    if isinstance(value, dict) and value and all(is_record(v) for v in value.values()):
        return list(keyed_records(value.items(), None)), f"a dict of records (their keys in field '{KEY_FIELD}')"
    if isinstance(value, tuple) and not hasattr(value, "_fields") and value:
        if all(is_record(e) for e in value):
            return [record_fields(e) for e in value], "a tuple of records"
        if all(isinstance(e, (list, tuple)) and all(is_record(x) for x in e) for e in value):
            return [record_fields(x) for e in value for x in e], f"a tuple of {len(value)} lists of records"
        lengths = {_length(e) for e in value}
        if alone and len(value) >= 2 and len(lengths) == 1 and None not in lengths:
            names = positional_names(len(value))
            return [{name: _row(e, i) for name, e in zip(names, value)} for i in range(lengths.pop())], \
                f"a tuple of {len(value)} sequences of {_length(value[0]):,} ({', '.join(names)}): one record per row"
        return [dict(zip(positional_names(len(value)), value))], f"one tuple of {len(value)} values: one record"
    return [record_fields(value)], "one record"


def positional_names(n: int) -> tuple[str, ...]:
    """Field names for the values of a tuple: x, y for two; "0", "1", ... otherwise."""
    return ("x", "y") if n == 2 else tuple(str(i) for i in range(n))


def _length(value) -> int | None:
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return len(value)
    if isinstance(value, np.ndarray) and value.ndim >= 1:
        return value.shape[0]
    return None


def _row(value, i: int):
    row = value[i]
    return row.item() if isinstance(row, np.ndarray) and row.ndim == 0 else row


def _damaged(path: Path, count: int, at: int, size: int, exc: BaseException, later: bool = False) -> InputError:
    """The one line for a pickle that does not read: cut short (truncate to keep the records before), or damaged
    (`later`: a dump after the first, read with a fresh memo, which a one-Pickler stream may also explain).
    """
    where = f"--records {path}: record {count:,} (at byte {at:,} of {size:,})"
    if isinstance(exc, EOFError):
        return InputError(f"{where} is cut short ({short(str(exc))}); rewrite the file, or, for a stream, truncate "
                          f"it to {at:,} bytes to keep the {count:,} records before")
    if isinstance(exc, (MemoryError, RecursionError)):
        return InputError(f"{where} asks for more than this machine holds ({type(exc).__name__}: "
                          f"{short(str(exc))}); the file is damaged or hostile: rewrite it")
    cause = " (or one Pickler wrote the dumps: write each with pickle.dump)" if later else ""
    return InputError(f"{where} does not read as a pickle ({type(exc).__name__}: {short(str(exc))}); the file is "
                      f"damaged{cause}: rewrite it")


# ====================================================================================== the unpickler


class _Reader(pickle._Unpickler):
    """pickle's pure-Python unpickler: globals through the allow-list, BUILD only on what it made itself,
    and a container's elements handed out at the ops where the scan found them complete.
    """

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, file, trust: bool):
        super().__init__(file)
        self.source, self.trust = file, trust
        self.last_get = None
        self.op = 0
        self.keys = 0

    def find_class(self, module: str, name: str):
        module, name, allowed = allowed_global(module, name, self.proto)
        if allowed is not None:
            return allowed
        if self.trust:
            try:
                return super().find_class(module, name)
            except (ImportError, AttributeError):  # not installed here: its objects are still read as state
                pass
        return stub_class(module, name)

    def load_build(self):
        state, inst = self.stack.pop(), self.stack[-1]
        if isinstance(inst, Pending):
            value = inst.build(state)
            self.stack[-1] = value
            for key in inst.keys:
                if self.memo.get(key) is inst:
                    self.memo[key] = value
        elif isinstance(inst, PickledObject):
            inst.__setstate__(state)
        elif self.trust:
            self.stack.append(state)
            pickle._Unpickler.load_build(self)
        else:
            raise refusal(f"the state of {short(getattr(inst, '__qualname__', type(inst).__name__))} (BUILD: only "
                          f"objects the file made are given their state)", does="sets")

    def _put(self, key: int) -> None:
        self.keys = max(self.keys, key + 1)
        value = self.stack[-1]
        if self.last_get is None or (key < len(self.last_get) and self.last_get[key] > self.op):
            self.memo[key] = value      # a slot no later op reads is not kept
            if isinstance(value, Pending):
                value.keys.append(key)

    def load_memoize(self):
        self._put(self.keys)

    def load_binput(self):
        self._put(self.read(1)[0])

    def load_long_binput(self):
        self._put(int.from_bytes(self.read(4), "little"))

    def load_put(self):
        self._put(int(self.readline()[:-1]))

    dispatch[pickle.MEMOIZE[0]] = load_memoize
    dispatch[pickle.BINPUT[0]] = load_binput
    dispatch[pickle.LONG_BINPUT[0]] = load_long_binput
    dispatch[pickle.PUT[0]] = load_put
    dispatch[pickle.BUILD[0]] = load_build

    def start(self, plan: PicklePlan, continued: bool) -> None:
        """Ready to read the pickle of `plan`: a fresh stack, and a fresh memo unless one Pickler wrote the file."""
        self.source.seek(plan.start)
        self._unframer = pickle._Unframer(self._file_read, self._file_readline)
        self.read, self.readinto, self.readline = self._unframer.read, self._unframer.readinto, self._unframer.readline
        self.metastack, self.stack = [], []
        self.append, self.proto, self.op = self.stack.append, 0, 0
        if not continued:
            self.memo, self.keys = {}, 0
        self.last_get = plan.last_get

    def whole(self, plan: PicklePlan, continued: bool):
        """The pickle's top object, built whole."""
        for value in self.elements(plan, [], continued, keyed=False, top=True):
            return value
        raise pickle.UnpicklingError("no STOP")

    def elements(self, plan: PicklePlan, handouts: list, continued: bool, keyed: bool, top: bool = False):
        """The elements completed at the ops `handouts` (sorted), each replaced by None on the stack; with
        `top`, the object STOP returns.
        """
        self.start(plan, continued)
        read, dispatch, ops = self.read, self.dispatch, iter(handouts)
        following = next(ops, -1)
        while True:
            code = read(1)
            if not code:
                raise EOFError("the file ends inside a pickle")
            if self.op == following:
                element = (self.stack[-2], self.stack[-1]) if keyed else self.stack[-1]
                self.stack[-1] = None
                yield element
                del element
                if self.last_get is not None:
                    for key in [k for k in self.memo if self.last_get[k] < self.op]:
                        del self.memo[key]
                following = next(ops, -1)
            try:
                dispatch[code[0]](self)
            except pickle._Stop as stop:
                if top:
                    yield stop.value
                return
            self.op += 1


def pickle_kind(path: Path) -> str:
    """"pickle-list" when the file's first pickle starts with a list or tuple, else "pickle-stream" (the
    manifest's label); InputError if the file is no pickle.
    """
    with open(path, "rb") as f:
        name = None
        while True:
            code = f.read(1)
            op = OPS.get(code[0]) if code else None
            if code and op is None:
                raise InputError(f"--records {path} is not a pickle (its first byte is no pickle opcode); pass a "
                                 f"pickle, an .npz or a .pt file of records")
            if op is None or op.name not in ("PROTO", "FRAME"):
                name = op.name if op else None
                break
            f.read(op.arg.n)
        if name == "MARK":  # protocols 0-1: MARK DICT is a dict, MARK LIST a list, MARK ... TUPLE a tuple
            following = OPS.get((f.read(1) or b"\0")[0])
            name = "EMPTY_DICT" if following is not None and following.name == "DICT" else name
    if name is None:
        raise InputError(f"--records {path} is empty: it holds no records")
    return "pickle-list" if name in ("EMPTY_LIST", "MARK", "LIST") else "pickle-stream"


__all__ = ["pickle_records", "pickle_kind", "element_records", "top_records", "positional_names"]
