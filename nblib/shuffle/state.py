"""Shuffle states as versioned, checksummed JSON: build, verify, (de)serialize, save and load.

A state is the shuffle's identity (algorithm, n, seed, epoch, layout), its progress (a position,
or the buffer's counters and base64 indices) and a crc32 over all of it; loading names the field
that is foreign, out of range or edited. Trade-off: a checksum catches damage and edits, not forgery.
"""
from __future__ import annotations

import base64
import json
import zlib
from pathlib import Path

import numpy as np

from nblib.errors import StateError

STATE_VERSION = 2  # 2: every state carries 'state_crc32'; 1 (before it) still loads, unchecked
READABLE_VERSIONS = (1, 2)
CHECKSUM_FIELD = "state_crc32"


def state_to_json(state: dict) -> str:
    """Compact JSON text of a state (what `state_bytes` counts)."""
    return json.dumps(state, separators=(",", ":"), sort_keys=True)


def load_state_json(text: str | bytes) -> dict:
    """Parse a state's JSON text; corrupt or truncated text raises StateError."""
    try:
        state = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise StateError(f"shuffle state is not valid JSON ({exc}): the file is corrupt or truncated; "
                         "use an older checkpoint or start the epoch afresh") from None
    if not isinstance(state, dict):
        raise StateError(f"shuffle state must be a JSON object, got {type(state).__name__}")
    return state


def state_bytes(shuffle) -> int:
    """Size in bytes of the shuffle's state as compact JSON."""
    return len(state_to_json(shuffle.state_dict()).encode())


def save_state(path: str | Path, shuffle) -> Path:
    """Write the shuffle's state to `path` atomically (temporary file, fsync, rename); return the path."""
    from nblib.atomic import atomic_write_bytes

    return atomic_write_bytes(path, state_to_json(shuffle.state_dict()).encode()).path


def load_state(path: str | Path, shuffle) -> None:
    """Load the state saved at `path` into `shuffle`; a missing or unreadable file is a StateError."""
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        raise StateError(f"no shuffle state at {path}: nothing was saved there (save_state writes it). "
                         "Check the path, or start the epoch afresh with a new shuffle") from None
    except OSError as exc:
        raise StateError(f"cannot read the shuffle state at {path} ({exc.strerror}): "
                         "pass the path of a file that save_state wrote") from None
    shuffle.load_state_dict(load_state_json(raw))


# ---------------------------------------------------------------- what the shuffle classes call


def state_header(shuffle) -> dict:
    """Version, algorithm and the identity fields a state must share with the shuffle that loads it."""
    fields = {name: getattr(shuffle, name) for name in shuffle.identity_fields}
    return {"version": STATE_VERSION, "algorithm": shuffle.algorithm, **fields}


def seal(state: dict) -> dict:
    """The state with its checksum 'state_crc32' over every other field added."""
    return {**state, CHECKSUM_FIELD: state_crc32(state)}


def open_state(shuffle, state) -> dict:
    """The state as a dict (from a dict or JSON text), refused if its version or identity differs."""
    state = as_state(state)
    if state.get("version", READABLE_VERSIONS[0]) not in READABLE_VERSIONS:
        raise StateError(f"state field 'version' is {state['version']!r}; this nblib reads versions "
                         f"{list(READABLE_VERSIONS)}: save the state again with this nblib or start the epoch afresh")
    for name, expected in state_header(shuffle).items():
        if name not in state:
            raise StateError(f"shuffle state has no field '{name}': it is not a nblib.shuffle state "
                             f"(fields: {sorted(state)})")
        if name != "version" and state[name] != expected:
            raise StateError(f"state field '{name}' is {state[name]!r} but this {type(shuffle).__name__} "
                             f"has {name}={expected!r}: the state belongs to another shuffle; build it with "
                             f"{name}={state[name]!r} or start the epoch afresh")
    return state


def verify_checksum(state: dict, progress_fields: tuple[str, ...]) -> None:
    """Refuse a state whose fields no longer match 'state_crc32', naming its progress fields.

    The identity fields were already compared with the loading shuffle, so a mismatch means a
    progress field (a position, a counter) was edited: loading it would skip or repeat samples.
    Version-1 states predate the checksum and load unchecked.
    """
    if CHECKSUM_FIELD not in state:
        if state["version"] == 1:
            return
        raise StateError(f"shuffle state has no field '{CHECKSUM_FIELD}' (a version-{state['version']} state "
                         "always carries one): the state was edited; use the file as saved or start the epoch afresh")
    expected = state_crc32(state)
    if state[CHECKSUM_FIELD] != expected:
        fields = ", ".join(f"'{name}'={state.get(name)!r}" for name in progress_fields)
        raise StateError(f"state field {fields} does not match the state's checksum ('{CHECKSUM_FIELD}' is "
                         f"{state[CHECKSUM_FIELD]!r}, the fields give {expected}): it was edited or damaged "
                         "after saving and would silently skip or repeat samples; use the state as saved, "
                         "an older checkpoint, or start the epoch afresh")


def state_crc32(state: dict) -> int:
    """crc32 of the compact JSON of every field but the checksum itself."""
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
    """An integer field of a state, within [low, high]."""
    value = state.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise StateError(f"state field '{name}' is {value!r}; it must be an integer in [{low}, {high}]")
    return value


def encode_indices(indices: list[int], n: int) -> dict:
    """The 'buffer' fields of a state: indices < n as little-endian base64, its dtype and crc32."""
    array = np.asarray(indices, dtype=index_dtype(n))
    raw = array.astype(array.dtype.newbyteorder("<")).tobytes()
    return {"buffer_dtype": array.dtype.name, "buffer_crc32": zlib.crc32(raw),
            "buffer": base64.b64encode(raw).decode("ascii")}


def decode_indices(state: dict, n: int, expected_len: int) -> np.ndarray:
    """Decode and verify the base64 'buffer' of a state (int64), naming the field that is wrong."""
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
