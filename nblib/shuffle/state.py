"""Shuffle states as nblib manifest records: build, verify, (de)serialize, save and load.

A state is one `nblib.manifest` record {kind, version, seq, body, sha256}: the body holds the
shuffle's identity (algorithm, n, seed, epoch, layout) and its progress (a position, or the
buffer's counters and base64 indices); the record's sha256 covers the body. Loading names the
field that is foreign, out of range or edited. States of earlier nblib versions (flat JSON,
version 2 with a crc32) still load, checked; version 1 predates any checksum, so it loads only
when the caller asks for an unchecked load. Trade-off: a checksum catches damage and edits, not forgery.
"""
from __future__ import annotations

import base64
import json
import operator
import zlib
from pathlib import Path

import numpy as np

from nblib.atomic import atomic_write_bytes
from nblib.errors import ConfigError, StateError
from nblib.manifest import body_sha256

STATE_KIND = "nblib.shuffle.state"
STATE_VERSION = 3  # 3: a manifest record; 2: flat JSON with 'state_crc32'; 1: flat, no checksum
LEGACY_VERSIONS = (1, 2)
CHECKSUM_FIELD = "state_crc32"  # the checksum of a version-2 (flat) state
UNCHECKED_HINT = "pass allow_unchecked=True to load it anyway, at your own risk"


def state_to_json(state: dict) -> str:
    """Compact JSON text of a state (what `state_bytes` counts)."""
    return json.dumps(state, separators=(",", ":"), sort_keys=True)


def load_state_json(text: str | bytes) -> dict:
    """Parse a state's JSON text; corrupt, truncated or absurdly nested text raises StateError."""
    try:
        state = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise StateError(f"shuffle state is not valid JSON ({exc}): the file is corrupt or truncated; "
                         "use an older checkpoint or start the epoch afresh") from None
    except RecursionError:
        raise StateError("shuffle state is not valid JSON for a state: it nests deeper than Python can "
                         "parse (a state is a flat record); the file is corrupt, use an older checkpoint "
                         "or start the epoch afresh") from None
    if not isinstance(state, dict):
        raise StateError(f"shuffle state must be a JSON object, got {type(state).__name__}")
    return state


def state_bytes(shuffle) -> int:
    """Size in bytes of the shuffle's state as compact JSON."""
    return len(state_to_json(shuffle.state_dict()).encode())


def save_state(path: str | Path, shuffle) -> Path:
    """Write the shuffle's state to `path` atomically (temporary file, fsync, rename); return the path."""
    return atomic_write_bytes(path, state_to_json(shuffle.state_dict()).encode()).path


def load_state(path: str | Path, shuffle, *, allow_unchecked: bool = False) -> None:
    """Load the state saved at `path` into `shuffle`; a missing or unreadable file is a StateError."""
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        raise StateError(f"no shuffle state at {path}: nothing was saved there (save_state writes it). "
                         "Check the path, or start the epoch afresh with a new shuffle") from None
    except OSError as exc:
        raise StateError(f"cannot read the shuffle state at {path} ({exc.strerror}): "
                         "pass the path of a file that save_state wrote") from None
    shuffle.load_state_dict(load_state_json(raw), allow_unchecked=allow_unchecked)


def state_fields(state: dict) -> dict:
    """The fields of a state (a record's body, or a legacy flat state itself)."""
    body = state.get("body") if "kind" in state else state
    if not isinstance(body, dict):
        raise StateError(f"shuffle state field 'body' is {type(body).__name__}, not an object: the state is corrupt")
    return body


# ---------------------------------------------------------------- what the shuffle classes call


def state_header(shuffle) -> dict:
    """The algorithm and the identity fields a state must share with the shuffle that loads it."""
    fields = {name: getattr(shuffle, name) for name in shuffle.identity_fields}
    return {"algorithm": shuffle.algorithm, **fields}


def seal(body: dict) -> dict:
    """The state record of `body`: a manifest record (kind, version, seq, body, sha256)."""
    return {"kind": STATE_KIND, "version": STATE_VERSION, "seq": 0, "body": body, "sha256": body_sha256(body)}


def open_state(shuffle, state, *, allow_unchecked: bool = False) -> tuple[dict, dict]:
    """(record, fields) of a state dict or JSON text, refused if its kind, version or identity differs."""
    state = as_state(state)
    fields = state_fields(state)
    if "kind" in state:
        if state["kind"] != STATE_KIND:
            raise StateError(f"state field 'kind' is {state['kind']!r}, not {STATE_KIND!r}: it is not a "
                             "nblib.shuffle state; pass what state_dict() or save_state wrote")
        if state.get("version") != STATE_VERSION:
            raise StateError(f"state field 'version' is {state.get('version')!r}; this nblib reads version "
                             f"{STATE_VERSION} records (and the flat versions {list(LEGACY_VERSIONS)}): save the "
                             "state again with this nblib or start the epoch afresh")
    elif fields.get("version", LEGACY_VERSIONS[0]) not in LEGACY_VERSIONS:
        raise StateError(f"state field 'version' is {fields['version']!r}; this nblib reads versions "
                         f"{[*LEGACY_VERSIONS, STATE_VERSION]}: save the state again with this nblib or start "
                         "the epoch afresh")
    elif fields.get("version", 1) == 1 and not allow_unchecked:
        raise StateError("shuffle state has 'version' 1 and no checksum: nothing shows whether its position "
                         "was edited or damaged, and loading an edited one silently skips or repeats samples. "
                         f"Use a state saved by this nblib, or, if you trust this file, {UNCHECKED_HINT}")
    for name, expected in state_header(shuffle).items():
        if name not in fields:
            raise StateError(f"shuffle state has no field '{name}': it is not a nblib.shuffle state "
                             f"(fields: {sorted(fields)})")
        value = fields[name]
        if name != "algorithm" and (isinstance(value, bool) or not isinstance(value, int)):
            raise StateError(f"state field '{name}' is {value!r}; it must be an integer (this "
                             f"{type(shuffle).__name__} has {name}={expected!r}): the state is damaged or was "
                             "written by something else; use the state as saved or start the epoch afresh")
        if value != expected:
            raise StateError(f"state field '{name}' is {value!r} but this {type(shuffle).__name__} "
                             f"has {name}={expected!r}: the state belongs to another shuffle; build it with "
                             f"{name}={value!r} or start the epoch afresh")
    return state, fields


def verify_checksum(state: dict, progress_fields: tuple[str, ...]) -> None:
    """Refuse a state whose fields no longer match its checksum, naming its progress fields.

    The identity fields were already compared with the loading shuffle, so a mismatch means a
    progress field (a position, a counter) was edited: loading it would skip or repeat samples.
    Version-1 states predate the checksum: `open_state` lets them through only when asked.
    """
    fields = state_fields(state)
    if "kind" in state:
        try:
            stored, expected, name = state.get("sha256"), body_sha256(fields), "sha256"
        except (RecursionError, TypeError, ValueError):
            raise StateError("shuffle state's body cannot be hashed (nested too deep or not JSON values): "
                             "the state is corrupt; use an older checkpoint or start the epoch afresh") from None
    else:
        if CHECKSUM_FIELD not in fields:
            if fields.get("version", 1) == 1:
                return
            raise StateError(f"shuffle state has no field '{CHECKSUM_FIELD}' (a version-{fields['version']} "
                             "state always carries one): the state was edited; use the file as saved or start "
                             "the epoch afresh")
        stored, expected, name = fields[CHECKSUM_FIELD], state_crc32(fields), CHECKSUM_FIELD
    if stored != expected:
        shown = ", ".join(f"'{f}'={fields.get(f)!r}" for f in progress_fields)
        raise StateError(f"state field {shown} does not match the state's checksum ('{name}' is "
                         f"{stored!r}, the fields give {expected}): it was edited or damaged "
                         "after saving and would silently skip or repeat samples; use the state as saved, "
                         "an older checkpoint, or start the epoch afresh")


def state_crc32(state: dict) -> int:
    """crc32 of the compact JSON of every field but the checksum itself (version-2 flat states)."""
    fields = {name: value for name, value in state.items() if name != CHECKSUM_FIELD}
    return zlib.crc32(state_to_json(fields).encode())


def as_state(state) -> dict:
    """Accept a state dict or its JSON text."""
    if isinstance(state, (str, bytes)):
        return load_state_json(state)
    if not isinstance(state, dict):
        raise StateError(f"shuffle state must be a dict or JSON text, got {type(state).__name__}")
    return state


def int_field(state: dict, name: str, low: int, high: int) -> int:
    """An integer field of a state's fields, within [low, high]."""
    value = state.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise StateError(f"state field '{name}' is {value!r}; it must be an integer in [{low}, {high}]")
    return value


def as_int(name: str, value) -> int:
    """A constructor argument that must be an integer (an int or numpy integer; not 1.0, not True)."""
    if isinstance(value, bool):
        raise ConfigError(f"{name}={value!r} must be an integer, not a bool")
    try:
        return operator.index(value)
    except TypeError:
        raise ConfigError(f"{name}={value!r} must be an integer ({type(value).__name__} given): "
                          f"pass {name}=int(...) of the value you mean") from None


def encode_indices(indices: list[int], n: int) -> dict:
    """The 'buffer' fields of a state: indices < n as little-endian base64, its dtype and crc32."""
    array = np.asarray(indices, dtype=index_dtype(n))
    raw = array.astype(array.dtype.newbyteorder("<")).tobytes()
    return {"buffer_dtype": array.dtype.name, "buffer_crc32": zlib.crc32(raw),
            "buffer": base64.b64encode(raw).decode("ascii")}


def decode_indices(state: dict, n: int, expected_len: int) -> np.ndarray:
    """Decode and verify the base64 'buffer' of a state's fields (int64), naming the field that is wrong."""
    dtype_name = state.get("buffer_dtype")
    if dtype_name != index_dtype(n).name:
        raise StateError(f"state field 'buffer_dtype' is {dtype_name!r}, expected {index_dtype(n).name!r}")
    try:
        raw = base64.b64decode(state.get("buffer", ""), validate=True)
    except (ValueError, TypeError) as exc:
        raise StateError(f"state field 'buffer' is not valid base64 ({exc}): the state is corrupt") from None
    if zlib.crc32(raw) != state.get("buffer_crc32"):
        raise StateError(f"state field 'buffer' fails its checksum (crc32 {zlib.crc32(raw)} != "
                         f"'buffer_crc32' {state.get('buffer_crc32')!r}): the state is corrupt")
    dtype = np.dtype(dtype_name).newbyteorder("<")
    if len(raw) != expected_len * dtype.itemsize:
        raise StateError(f"state field 'buffer' holds {len(raw) // dtype.itemsize} indices, expected "
                         f"{expected_len} (cursor - emitted): the state is corrupt")
    return np.frombuffer(raw, dtype=dtype).astype(np.int64)


def index_dtype(n: int) -> np.dtype:
    """The narrowest unsigned dtype holding indices < n (uint32 up to 4 billion samples)."""
    return np.dtype(np.uint32) if n <= 2**32 else np.dtype(np.uint64)
