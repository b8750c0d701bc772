"""The shape of each pickle in a file, read from its opcodes without building anything.

Pickles are postfix: in `pickle.dump((X, y))` the first opcodes are X's, and only the op before
STOP says what the top object is. `PickleScanner.scan(start)` walks one pickle's opcodes,
simulating the unpickler's stack with a small `_Item` per value (its kind, the global that made it,
and for the lists, dicts and tuples at the bottom of the stack where each element ends and what it
is), and returns a `PicklePlan`: the top object as STOP returns it, never guessed from the first
opcode, and the last op reading each memo slot. Big byte strings are skipped with a seek, after
checking that the file holds them; memo slots keep a kind code (a byte), and only the few items a
later GET needs whole (globals, short strings, bottom containers). The trade-off: one more pass over
the opcodes in pure Python (about 3 us an opcode, ~8x what `pickle.load` spends on the whole file
for small records), which buys streaming a container of any size in about one record's RAM, and a
plan that cannot drop part of the file.

Memo numbering: separate `pickle.dump` calls each number their memo from 0 (protocol 4's MEMOIZE
takes the next number implicitly), while one `Pickler` dumping several objects continues its
numbering and reads earlier dumps' objects. A pickle after the first that reads a slot it did not
write raises `NotFresh`: the file is then read as one `Pickler`'s stream, the memo carried over.
A slot written out of order (past the next free one, or negative) is refused: no pickler writes it.
"""
from __future__ import annotations

import collections
import dataclasses
import pickle
import pickletools
from array import array

from nblib.cache.pickle_globals import global_kind
from nblib.errors import InputError

OPS = {op.code.encode("latin-1")[0]: op for op in pickletools.opcodes}
_COUNTED = {pickletools.TAKEN_FROM_ARGUMENT1: (1, False), pickletools.TAKEN_FROM_ARGUMENT4: (4, True),
            pickletools.TAKEN_FROM_ARGUMENT4U: (4, False), pickletools.TAKEN_FROM_ARGUMENT8U: (8, False)}
_STRINGS = {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "SHORT_BINSTRING", "BINSTRING", "STRING"}
_NEW = {"EMPTY_LIST": "list", "EMPTY_DICT": "dict", "EMPTY_TUPLE": "tuple", "EMPTY_SET": "set"}
_MARKED = {"LIST": "list", "DICT": "dict", "TUPLE": "tuple", "FROZENSET": "set"}
_TUPLES = {"TUPLE1": 1, "TUPLE2": 2, "TUPLE3": 3}
_CALLS = {"REDUCE": 2, "NEWOBJ": 2, "NEWOBJ_EX": 3}       # the callable is the deepest of the items popped
_REFUSED = {**dict.fromkeys(("PERSID", "BINPERSID"), "a persistent id (pickled with a persistent_id hook)"),
            **dict.fromkeys(("EXT1", "EXT2", "EXT4"), "an extension code (copyreg.add_extension)"),
            **dict.fromkeys(("NEXT_BUFFER", "READONLY_BUFFER"),
                            "an out-of-band buffer (dumped with buffer_callback; dump without it)")}
_MEMOIZE, _BINGET, _MARK = -1, -2, -3
_FAST = {**{op.code.encode("latin-1"): op.arg.n if op.arg else 0 for op in pickletools.opcodes
            if op.name in ("NONE", "NEWTRUE", "NEWFALSE", "BININT", "BININT1", "BININT2", "BINFLOAT")},
         b"\x94": _MEMOIZE, b"h": _BINGET, b"(": _MARK}
_MEMO_ITEMS = 4096             # memoized items kept whole (globals, short strings, containers at the bottom)
_KEEP_CHILDREN = 64            # a tuple keeps its items' shapes when it has at most this many (X, y)


class _Item:
    """One value on the simulated stack: its kind ("list", "dict", "tuple", "set", "call", "global",
    "str", "value"), the global's dotted name for calls and globals, and for containers whose elements
    may be served one at a time, where each element ends and what it is.
    """

    __slots__ = ("kind", "name", "ends", "kinds", "children", "open", "self_read", "text")

    def __init__(self, kind: str, name: str | None = None):
        self.kind, self.name, self.text = kind, name, None
        self.ends, self.kinds, self.children = None, None, None
        self.open, self.self_read = kind in ("list", "dict"), False

    def add(self, end: int, element: _Item) -> None:
        if self.ends is None:
            self.ends, self.kinds = array("q"), bytearray()
        self.ends.append(end)
        self.kinds.append(element.code())
        element.ends = element.kinds = element.children = None   # an element's own elements are never served

    def code(self) -> int:
        """What this value is to a reader of records: RECORD, LIST, TUPLE or OTHER (an array, a scalar...)."""
        if self.kind in ("list", "tuple"):
            return LIST if self.kind == "list" else TUPLE
        if self.kind == "dict" or (self.kind == "call" and global_kind(self.name) == "record"):
            return RECORD
        return OTHER


VALUE = _Item("value")
RECORD, LIST, TUPLE, OTHER = b"rlto"


@dataclasses.dataclass
class PicklePlan:
    """One pickle of a file: its top object as STOP returns it, and the last op reading each memo slot."""

    start: int
    end: int                          # the byte after its STOP
    top: _Item
    last_get: array | None            # None: one Pickler wrote the file, every slot may be read later


class NotFresh(pickle.UnpicklingError):
    """A pickle read a memo slot it did not write: a stream written by one Pickler."""


class PickleScanner:
    """Scans the pickles of a file one at a time (`scan(start)`), op indices counted from each PROTO.

    `continued=False`: each pickle numbers its memo from 0 and `scan` raises `NotFresh` when a pickle
    after the first reads a slot it did not write; `continued=True`: the memo carries over.
    """

    def __init__(self, f, size: int, continued: bool = False):
        self.f, self.size, self.continued = f, size, continued
        self.items: collections.OrderedDict[int, _Item] = collections.OrderedDict()   # the few kept whole
        self.codes = bytearray()      # per memo slot: its value's kind code (0: not written)
        self.keys = 0
        self.pickles = 0

    def scan(self, start: int) -> PicklePlan:
        """Scan the pickle at byte `start` to its STOP."""
        f = self.f
        f.seek(start)
        if not self.continued:
            self.items, self.codes, self.keys = collections.OrderedDict(), bytearray(), 0
        self.levels: list[list] = [[]]     # per mark level: [op index where the item starts, _Item]
        self.marks: list[int] = []
        self.last_get = array("q", [-1] * len(self.codes))
        self.index = 0
        read, top, fast = f.read, self.levels[-1], _FAST
        while True:
            code = read(1)
            if not code:
                raise EOFError("the file ends inside a pickle")
            width = fast.get(code)
            if width is not None:                 # the commonest opcodes, inline (half the scan's time)
                index = self.index
                self.index += 1
                top = self.levels[-1]
                if width >= 0:                    # a plain value with a fixed-size argument: pushed
                    if width and len(read(width)) != width:
                        raise EOFError("the file ends inside an opcode")
                    top.append([index, VALUE])
                elif width == _MEMOIZE:
                    self.put(self.keys)
                elif width == _BINGET:
                    key = read(1)
                    if not key:
                        raise EOFError("the file ends inside an opcode")
                    self.get(key[0], index)
                else:                             # MARK
                    self.levels.append([])
                    self.marks.append(index)
                continue
            op = OPS.get(code[0])
            if op is None:
                raise pickle.UnpicklingError(f"byte {f.tell() - 1:,} is no pickle opcode ({code!r})")
            name = op.name
            if name in _REFUSED:
                raise InputError(f"the pickle holds {_REFUSED[name]}, which nblib does not read; dump the "
                                 f"records with plain pickle.dump")
            arg = self.read_arg(op)
            index = self.index
            self.index += 1
            if name == "STOP":
                if len(self.levels) != 1 or len(self.levels[0]) != 1:
                    raise pickle.UnpicklingError("STOP with other than one object on the stack")
                self.pickles += 1
                return PicklePlan(start, f.tell(), self.levels[0][0][1], None if self.continued else self.last_get)
            self.apply(name, op, arg, index)

    def read_arg(self, op):
        """Read (or seek past) an opcode's argument: a memo slot, a global's name, a short string, or None."""
        arg, f = op.arg, self.f
        if arg is None:
            return None
        n = arg.n
        if n >= 0:
            data = f.read(n)
            if len(data) != n:
                raise EOFError("the file ends inside an opcode")
            return int.from_bytes(data, "little") if op.name in ("LONG_BINGET", "BINPUT", "LONG_BINPUT") else None
        if n == pickletools.UP_TO_NEWLINE:
            line = f.readline()
            if op.name in ("GLOBAL", "INST"):
                second = f.readline()
                if not second.endswith(b"\n"):
                    raise EOFError("the file ends inside an opcode")
                return line[:-1].decode("utf-8", "replace") + "." + second[:-1].decode("utf-8", "replace")
            if not line.endswith(b"\n"):
                raise EOFError("the file ends inside an opcode")
            if op.name in ("GET", "PUT"):
                return int(line)
            return line[:-1] if op.name in ("UNICODE", "STRING") else None
        width, signed = _COUNTED[n]
        size = int.from_bytes(f.read(width), "little", signed=signed)
        if size < 0 or f.tell() + size > self.size:
            raise pickle.UnpicklingError(f"{op.name} at byte {f.tell() - width - 1:,} claims {size:,} bytes; the "
                                         f"file holds {self.size - f.tell():,} more")
        if op.name in _STRINGS and size <= 256:
            return f.read(size)
        f.seek(size, 1)
        return None

    def apply(self, name: str, op, arg, index: int) -> None:
        """The stack after one opcode (MARK, MEMOIZE, BINGET and the plain values of `_FAST` never reach it)."""
        top = self.levels[-1]
        if name in ("PROTO", "FRAME"):
            return
        if name in ("POP", "POP_MARK"):
            if name == "POP" and top:
                top.pop()
            else:
                self.pop_mark()
        elif name == "DUP":
            top.append(self.need(1)[-1])
        elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
            self.put(arg)
        elif name in ("GET", "LONG_BINGET"):
            self.get(arg, index)
        elif name in _NEW:
            top.append([index, _Item(_NEW[name])])
        elif name in _STRINGS:
            item = _Item("str")
            item.text = arg
            top.append([index, item])
        elif name == "GLOBAL":
            top.append([index, _Item("global", arg)])
        else:
            self.apply_popping(name, op, arg, index)

    def apply_popping(self, name: str, op, arg, index: int) -> None:
        """The opcodes that take items off the stack."""
        if name in ("APPEND", "SETITEM"):
            n = 1 if name == "APPEND" else 2
            items = self.need(n + 1)
            container = items[0][1]
            del self.levels[-1][-n:]
            if container.open:
                container.add(index, items[-1][1])
        elif name in ("APPENDS", "SETITEMS", "ADDITEMS"):
            mark, items = self.pop_mark()
            container = self.need(1)[-1][1]
            per = 2 if name == "SETITEMS" else 1
            if container.open and name != "ADDITEMS" and len(items) % per == 0:
                for k in range(per - 1, len(items), per):
                    container.add(items[k + 1][0] if k + 1 < len(items) else index, items[k][1])
        elif name in _MARKED or name in ("OBJ", "INST"):
            mark, items = self.pop_mark()
            self.levels[-1].append([mark, self.marked(name, items, arg, index)])
        elif name in _TUPLES:
            items = self.need(_TUPLES[name])
            del self.levels[-1][-len(items):]
            self.levels[-1].append([items[0][0], self.tuple_of(items, index)])
        elif name in _CALLS or name == "STACK_GLOBAL":
            self.call(name, index)
        elif name == "BUILD":
            self.need(2)
            self.levels[-1].pop()
        else:
            self.generic(op, index)

    def marked(self, name: str, items: list, arg, index: int) -> _Item:
        """The item a MARK-based opcode makes of the items above its mark."""
        if name == "TUPLE":
            return self.tuple_of(items, index)
        if name == "INST":
            return _Item("call", arg)
        if name == "OBJ":
            return _Item("call", items[0][1].name if items else None)
        item = _Item(_MARKED[name])
        if item.open and items:      # protocol 0-1 LIST / DICT over items already on the stack
            per = 2 if name == "DICT" else 1
            for k in range(per - 1, len(items), per):
                item.add(items[k + 1][0] if k + 1 < len(items) else index, items[k][1])
        return item

    def tuple_of(self, items: list, index: int) -> _Item:
        tup = _Item("tuple")
        if len(items) <= _KEEP_CHILDREN and self.at_bottom():
            tup.children = [(items[k + 1][0] if k + 1 < len(items) else index, item) for k, (_, item)
                            in enumerate(items)]
        return tup

    def call(self, name: str, index: int) -> None:
        """REDUCE, NEWOBJ(_EX): an object made by a global; STACK_GLOBAL: the global named by two strings."""
        n = 2 if name == "STACK_GLOBAL" else _CALLS[name]
        items = self.need(n)
        del self.levels[-1][-n:]
        if name == "STACK_GLOBAL":
            module, qualname = (item.text for _, item in items)
            dotted = None if module is None or qualname is None else \
                f"{module.decode('utf-8', 'replace')}.{qualname.decode('utf-8', 'replace')}"
            self.levels[-1].append([items[0][0], _Item("global", dotted)])
        else:
            self.levels[-1].append([items[0][0], _Item("call", items[0][1].name)])

    def generic(self, op, index: int) -> None:
        before = op.stack_before
        if pickletools.markobject in before:
            mark, _ = self.pop_mark()
            start = mark
        else:
            items = self.need(len(before))
            if items:
                del self.levels[-1][-len(items):]
            start = items[0][0] if items else index
        self.levels[-1].extend([start, VALUE] for _ in op.stack_after)

    def need(self, n: int) -> list:
        top = self.levels[-1]
        if len(top) < n:
            raise pickle.UnpicklingError(f"an opcode needs {n} items on a stack of {len(top)}")
        return top[-n:] if n else []

    def pop_mark(self) -> tuple[int, list]:
        if not self.marks:
            raise pickle.UnpicklingError("an opcode needs a MARK and there is none")
        return self.marks.pop(), self.levels.pop()

    def at_bottom(self) -> bool:
        """Whether the stack's top level is its bottom: where the top object and its tuple's items are built."""
        return len(self.levels) == 1 or (len(self.levels) == 2 and not self.levels[0])

    def put(self, key: int) -> None:
        """Memoize the top item: its kind code always; the item itself only where a later GET needs more (a
        global's name, a short string that may name one, a container that may be served).
        """
        top = self.levels[-1]
        if not top:
            raise pickle.UnpicklingError("a memo write with nothing on the stack")
        item, keys = top[-1][1], self.keys
        if key == keys:                           # what every pickler writes: the next slot
            self.codes.append(item.code())
            if not self.continued:
                self.last_get.append(-1)
            self.keys = keys + 1
        elif 0 <= key < keys:
            self.codes[key] = item.code()
            self.items.pop(key, None)
        elif not self.continued and self.pickles:   # numbered on from an earlier dump: one Pickler's stream
            raise NotFresh
        else:
            raise pickle.UnpicklingError(f"memo slot {key} is written while {keys} slots are: a pickler writes "
                                         f"slot {keys} next, or rewrites one")
        kind = item.kind
        if kind == "global" or (kind == "str" and item.text is not None and len(item.text) <= 64) \
                or (kind in ("list", "dict", "tuple") and self.at_bottom()):
            self.items[key] = item
            if len(self.items) > _MEMO_ITEMS:
                self.items.popitem(last=False)

    def get(self, key: int, index: int) -> None:
        if key >= len(self.codes) or not self.codes[key]:
            if not self.continued and self.pickles:
                raise NotFresh
            raise pickle.UnpicklingError(f"memo slot {key} is read before it is written")
        item = self.items.get(key) or _PLACEHOLDERS[self.codes[key]]
        if not self.continued:
            self.last_get[key] = index
        if item.open:
            item.self_read = True
        self.levels[-1].append([index, item])


def _placeholder(code: int) -> _Item:
    """A memoized value known by its kind code only: closed, so nothing adds to it (one per code, shared)."""
    item = _Item({RECORD: "dict", LIST: "list", TUPLE: "tuple"}.get(code, "value"))
    item.open = False
    return item


_PLACEHOLDERS = {code: _placeholder(code) for code in (RECORD, LIST, TUPLE, OTHER)}
