"""Any pickle of records, one record at a time: a stream of dumps, or one list, tuple or dict of any size.

`pickle_records(path)` yields the records of a file holding one or more pickles (`pickle.dump` in a
loop, or one `pickle.dump(all_records)`, or both). A pickle whose top object is a list, tuple or dict
is not unpickled whole: its elements are served one at a time, RAM about one record whatever the
file's size. How:

1. `scan_pickle` walks the pickle's opcodes once without building anything (big byte strings are
   skipped with a seek), simulating the unpickler's stack. It finds where each element of the top
   container ends (the op after it), and for each memo slot the last op that reads it.
2. A pure-Python unpickler (`pickle._Unpickler`, globals resolved through
   `nblib.cache.pickle_globals`) runs the pickle; at each element's end it takes the element off the
   stack and hands it out instead of adding it to the container, and drops the memo slots no later
   op reads. Memo slots the elements share (a class, field names, a dtype) live as long as needed;
   a record's own arrays leave with it.

A pickle whose top object is a record (a dict, an object) is unpickled as one record; a dict whose
values are records is a dict of records (its values are served), else it is one record.
"""
from __future__ import annotations

import dataclasses
import pickle
import pickletools
from array import array
from collections.abc import Iterator
from pathlib import Path

from nblib.cache.pickle_globals import allowed_global, is_record, record_fields, stub_class
from nblib.errors import InputError

_OPS = {op.code.encode("latin-1")[0]: op for op in pickletools.opcodes}
_EFFECT = {}   # opcode -> (items below the mark popped, or None: no mark; items popped; items pushed)
for _code, _op in _OPS.items():
    _before, _after = _op.stack_before, _op.stack_after
    if pickletools.markobject in _before:
        _EFFECT[_code] = (_before.index(pickletools.markobject), 0, len(_after))
    else:
        _EFFECT[_code] = (None, len(_before), len(_after))
_CONTAINERS = {"EMPTY_LIST": 1, "EMPTY_DICT": 2}
_GETS = {"GET", "BINGET", "LONG_BINGET"}
_PUTS = {"PUT", "BINPUT", "LONG_BINPUT"}


@dataclasses.dataclass
class Plan:
    """The shape of one pickle whose top object is a container, read by `scan_pickle` without unpickling."""

    per: int                 # stack items per element: 1 (list, tuple) or 2 (dict: key, value)
    ends: array              # the op index at which each element is complete; -1 - index where the element is
                             # added alone (APPEND / SETITEM: protocol 0, or a last batch of one)
    last_get: array          # per memo slot, the last op index reading it (-1: never read)


def first_op(f, start: int) -> str | None:
    """The name of the first opcode of the pickle at `start` past PROTO and FRAME (None at the end of the file)."""
    f.seek(start)
    while True:
        code = f.read(1)
        if not code:
            return None
        op = _OPS.get(code[0])
        if op is None:
            raise InputError(f"byte {start:,} starts no pickle opcode ({code!r})")
        if op.name not in ("PROTO", "FRAME"):
            return op.name
        f.read(op.arg.n)


def scan_pickle(f, start: int) -> Plan | None:
    """The `Plan` of the pickle at byte `start` of `f` when its top object is a list, tuple or dict; else None."""
    name = first_op(f, start)
    if name not in ("EMPTY_LIST", "EMPTY_DICT", "MARK"):
        return None
    f.seek(start)
    stack = _Stack()
    ends, last_get = array("q"), array("q")
    per, ready, batch, keys, index = _CONTAINERS.get(name, 1), name != "MARK", False, 0, 0
    tuple_mode = False
    while True:
        code = f.read(1)
        if not code:
            raise EOFError("the file ends inside a pickle")
        op = _OPS.get(code[0])
        if op is None:
            raise pickle.UnpicklingError(f"byte {f.tell() - 1:,} is no pickle opcode ({code!r})")
        key, name = _read_arg(f, op), op.name
        if name in _GETS:
            if key >= len(last_get):
                raise pickle.UnpicklingError(f"memo slot {key} is read before it is written")
            last_get[key] = index
        elif name in _PUTS or name == "MEMOIZE":
            keys = max(keys, (keys if name == "MEMOIZE" else key) + 1)
            last_get.extend([-1] * (keys - len(last_get)))
        elif name == "STOP":
            return Plan(per, ends, last_get)
        if batch and len(stack.levels) == 2 and _EFFECT[code[0]][0] is not None:   # the op closing a batch
            starts, batch = stack.levels[1], False
            if name in (("TUPLE",) if tuple_mode else ("APPENDS", "SETITEMS")) and not len(starts) % per:
                ends.extend(starts[per::per])
                ends.extend([index] if starts else [])
            elif tuple_mode:
                raise InputError(f"the pickle's top object is built by {name} over {len(starts)} items; records "
                                 f"come one per pickle, or in a list, tuple or dict")
            # else: that MARK began an element of a container filled one APPEND / SETITEM at a time
        elif ready and name in ("APPEND", "SETITEM") and len(stack.levels) == 1 and len(stack.levels[0]) == 1 + per:
            ends.append(-1 - index)
        if not ready and name != "FRAME" and stack.marks and index > stack.marks[0]:
            ready = True
            if name in ("LIST", "DICT"):
                per = 1 if name == "LIST" else 2     # protocols 0-1: MARK LIST (empty), then APPENDs
            else:
                batch = tuple_mode = True            # MARK elements TUPLE: a tuple of records
        stack.apply(code[0], index, name)
        if ready and name == "MARK" and len(stack.levels) == 2 and len(stack.levels[0]) == 1:
            batch = True                             # [container] MARK elements APPENDS, or an element's MARK
        index += 1


class _Stack:
    """The unpickler's stack as the op index each item started at (a mark's own index included)."""

    def __init__(self):
        self.levels: list[list[int]] = [[]]
        self.marks: list[int] = []

    def apply(self, code: int, index: int, name: str) -> None:
        below, pops, pushes = _EFFECT[code]
        levels = self.levels
        if name == "MARK":
            levels.append([])
            self.marks.append(index)
            return
        if name == "POP" and not levels[-1]:
            levels.pop()
            self.marks.pop()
            return
        if below is not None:
            popped = levels.pop() + [self.marks.pop()]
            pops = below
        else:
            popped = []
        if pops:
            if len(levels[-1]) < pops:
                raise pickle.UnpicklingError(f"{name} at op {index} pops an empty stack")
            popped += levels[-1][-pops:]
            del levels[-1][-pops:]
        levels[-1].extend([min(popped) if popped else index] * pushes)


def _read_arg(f, op) -> int:
    """Read (or seek past) an opcode's argument; the memo slot of GET/PUT ops, else 0."""
    arg = op.arg
    if arg is None:
        return 0
    n = arg.n
    if n >= 0:
        data = f.read(n)
        if len(data) != n:
            raise EOFError
        return int.from_bytes(data, "little") if op.name in ("BINGET", "LONG_BINGET", "BINPUT", "LONG_BINPUT") else 0
    if n == pickletools.UP_TO_NEWLINE:
        line = f.readline()
        if op.name in ("GLOBAL", "INST"):
            line = f.readline()
        if not line.endswith(b"\n"):
            raise EOFError
        return int(line) if op.name in ("GET", "PUT") else 0
    width, signed = {pickletools.TAKEN_FROM_ARGUMENT1: (1, False), pickletools.TAKEN_FROM_ARGUMENT4: (4, True),
                     pickletools.TAKEN_FROM_ARGUMENT4U: (4, False), pickletools.TAKEN_FROM_ARGUMENT8U: (8, False)}[n]
    size = int.from_bytes(f.read(width), "little", signed=signed)
    if size < 0:
        raise pickle.UnpicklingError(f"{op.name} of negative length {size}")
    f.seek(size, 1)
    return 0


# ====================================================================================== reading


class _Unpickler(pickle._Unpickler):
    """pickle's pure-Python unpickler: globals through the allow-list; a container's elements handed out."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, file, trust: bool):
        super().__init__(file)
        self.trust = trust
        self.last_get: array | None = None
        self.op = 0
        self.keys = 0

    def find_class(self, module: str, name: str):
        if self.proto < 3:
            from _compat_pickle import IMPORT_MAPPING, NAME_MAPPING

            module, name = NAME_MAPPING.get((module, name), (IMPORT_MAPPING.get(module, module), name))
        allowed = allowed_global(module, name)
        if allowed is not None:
            return allowed
        if self.trust:
            try:
                return super().find_class(module, name)
            except (ImportError, AttributeError):  # not installed here: its objects are still read as state
                pass
        return stub_class(module, name)

    def _put(self, key: int) -> None:
        self.keys = max(self.keys, key + 1)
        if self.last_get is None or self.last_get[key] > self.op:  # a slot no later op reads is not kept
            self.memo[key] = self.stack[-1]

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

    def items(self, plan: Plan | None) -> Iterator:
        """The top object of the next pickle (plan None), or its container's elements one by one."""
        self._unframer = pickle._Unframer(self._file_read, self._file_readline)
        self.read, self.readinto, self.readline = self._unframer.read, self._unframer.readinto, self._unframer.readline
        self.metastack, self.stack, self.memo = [], [], {}
        self.append, self.proto, self.keys, self.op = self.stack.append, 0, 0, 0
        self.last_get = plan.last_get if plan else None
        ends = plan.ends if plan else array("q")
        read, dispatch, done, skip = self.read, self.dispatch, 0, (pickle.APPEND[0], pickle.SETITEM[0])
        following, single = _end(ends, 0)
        while True:
            code = read(1)
            if not code:
                raise EOFError("the file ends inside a pickle")
            if self.op == following:
                element = self.stack[-plan.per:]
                if len(element) != plan.per or len(self.metastack) != (0 if single else 1):
                    raise pickle.UnpicklingError(f"element {done} does not end where the scan found it")
                del self.stack[-plan.per:]
                yield element[0] if plan.per == 1 else tuple(element)
                del element
                for key in [k for k in self.memo if self.last_get[k] < self.op]:
                    del self.memo[key]
                done += 1
                if single and code[0] in skip:
                    following, single = _end(ends, done)
                    self.op += 1
                    continue
                following, single = _end(ends, done)
            try:
                dispatch[code[0]](self)
            except pickle._Stop as stop:
                if plan is None:
                    yield stop.value
                return
            self.op += 1


def _end(ends: array, k: int) -> tuple[int, bool]:
    """(op index, added alone) of element k's end; (-1, False) past the last."""
    if k >= len(ends):
        return -1, False
    return (ends[k], False) if ends[k] >= 0 else (-1 - ends[k], True)


def pickle_records(path: Path, trust: bool = False) -> Iterator:
    """The records of a file of pickles, one at a time (see the module's docstring); dicts of fields."""
    size = path.stat().st_size
    with open(path, "rb") as f, open(path, "rb") as scan:
        unpickler, index = _Unpickler(f, trust), 0
        while f.tell() < size:
            at = f.tell()
            try:
                plan = scan_pickle(scan, at)
                fields = None   # a dict whose values are not records: one record, its items the fields
                for n, item in enumerate(unpickler.items(plan)):
                    if plan is not None and plan.per == 2:
                        if n == 0 and not is_record(item[1]):
                            fields = {}
                        if fields is not None:
                            fields[item[0]] = item[1]
                            continue
                        item = item[1]
                    for record in _records_of(item, plan is None):
                        yield record
                        index += 1
                if fields is not None:
                    yield fields
                    index += 1
            except InputError:
                raise
            except (EOFError, pickle.UnpicklingError, ValueError, IndexError, KeyError) as exc:
                raise InputError(f"--records {path}: record {index:,} (at byte {at:,} of {size:,}) is cut short or "
                                 f"damaged ({type(exc).__name__}: {exc}); rewrite the file, or, for a stream, "
                                 f"truncate it to {at:,} bytes to keep the {index:,} records before") from None


def _records_of(item, top: bool):
    """A top object that is a short tuple or list (TUPLE1-3) is records; anything else is one record."""
    if top and isinstance(item, (list, tuple)) and not hasattr(item, "_fields"):
        return [record_fields(x) for x in item]
    return [record_fields(item)]


def pickle_kind(path: Path) -> str:
    """"pickle-list" when the file's first pickle is a list or tuple, else "pickle-stream"; InputError if no pickle."""
    with open(path, "rb") as f:
        try:
            name = first_op(f, 0)
            if name == "MARK":  # protocols 0-1: MARK DICT is a dict, MARK LIST a list, MARK ... TUPLE a tuple
                following = _OPS.get((f.read(1) or b"\0")[0])
                name = "EMPTY_DICT" if following is not None and following.name == "DICT" else name
        except InputError:
            raise InputError(f"--records {path} is not a pickle (its first byte is no pickle opcode); pass a "
                             f"pickle, an .npz or a .pt file of records") from None
    if name is None:
        raise InputError(f"--records {path} is empty: it holds no records")
    return "pickle-list" if name in ("EMPTY_LIST", "MARK", "LIST") else "pickle-stream"
