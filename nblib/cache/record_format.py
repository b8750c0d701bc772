"""Record shards' bytes: one record (named arrays + scalar fields) as a payload, shards, the manifest.

A record is a dict of numpy arrays (any dtype but object, bfloat16 included, any shape, which may
differ between records, 0-length too) and scalar fields (int, float, bool, str, None). Its payload is
a uint32 header length, a compact key-sorted JSON header (each array's name, dtype, shape and offset; the scalars'
values), then the arrays' bytes, each 8-byte aligned: the same record always gives the same
bytes. A stored record is its payload compressed with zstd (each record alone, so any record reads
alone) or the payload itself (codec "raw").

A shard file (`shard-00000.rec`) has the image cache's packed layout (`nblib.cache.format`): the
header (codec, and (0, 0, RECORD_LAYOUT) where images keep their shape, so neither reader takes
the other's shards), the stored records, a uint64 offsets index, one xxh3-64 per stored record
and the trailer; `open_packed` maps it and every read checks its record's xxh3. Shards are written
through the one `AtomicWriter` (sha256 as written) plus a whole-file xxh3, so a shard is complete
and listed in the manifest, or it does not exist.

The manifest (`manifest.json`, an `nblib.manifest` record of kind "nblib.records") holds the
source, the layout (codec, shard bytes, group key), the fields' schema, and each shard's index,
key, record count, stored and raw bytes, the largest shape of each array field, sha256, xxh3 and
the xxh3 of its records' payloads (what a resume checks the input against).
"""
from __future__ import annotations

import functools
import json
import numbers
import struct
from pathlib import Path

import numpy as np

from nblib.cache.codecs import ZSTD_LEVEL
from nblib.cache.format import (
    HEADER,
    RECORDS_KIND,
    SHARD_MAGIC,
    SealedShard,
    read_shards_manifest,
)
from nblib.cache.pickle_globals import bfloat16, storage_dtype
from nblib.errors import InputError
from nblib.manifest import write_manifest

MANIFEST = "manifest.json"
MANIFEST_KIND = RECORDS_KIND
MANIFEST_VERSION = 1
RECORD_LAYOUT = 1               # the payload layout above; sits where image shards keep their shape
RECORD_SHAPE = (0, 0, RECORD_LAYOUT)   # what a record shard's header holds for an image shard's shape
RECORD_CODECS = ("zstd", "raw")   # levels and their checks: the image codecs' (`nblib.cache.codecs.CODECS`)
SHARD_SUFFIX = ".rec"
ALIGN = 8
LENGTH = struct.Struct("<I")
SCALAR_TYPES = (bool, int, float, str, type(None))


# ====================================================================================== one record


def encode_record(record: dict, index: int = 0) -> bytearray:
    """The payload of one record (deterministic bytes, in the one buffer they are built in: no copy); InputError
    naming a field it cannot hold.
    """
    if not isinstance(record, dict) or not record:
        raise InputError(f"record {index:,} is a {type(record).__name__}, not a non-empty dict of "
                         f"arrays and scalars; each record must be a dict such as "
                         f"{{'hidden_states': array, 'layer_id': 3}}")
    arrays, scalars, offset = [], {}, 0
    for name in sorted(record, key=str):
        value = as_field(record[name], name, index)
        if isinstance(value, np.ndarray):
            arrays.append((str(name), value, offset))
            offset += _aligned(value.nbytes)
        else:
            scalars[str(name)] = _json_scalar(value)
    header = json.dumps({"a": [[n, dtype_code(a.dtype), list(a.shape), o] for n, a, o in arrays], "s": scalars},
                        sort_keys=True, separators=(",", ":"), allow_nan=True).encode()
    start = _aligned(LENGTH.size + len(header))
    payload = bytearray(start + offset)
    LENGTH.pack_into(payload, 0, len(header))
    payload[LENGTH.size:LENGTH.size + len(header)] = header
    view = memoryview(payload)    # a slice of the bytearray itself would first copy the array into a temporary
    for _name, array, at in arrays:  # as flat bytes: a 0-length array has no memoryview cast
        view[start + at:start + at + array.nbytes] = memoryview(np.ascontiguousarray(array).reshape(-1).view("u1"))
    view.release()
    return payload


def decode_record(payload) -> dict:
    """The record of a payload: writable numpy arrays and Python scalars (ValueError if malformed)."""
    buffer = payload if isinstance(payload, bytearray) else bytearray(payload)
    try:
        (length,) = LENGTH.unpack_from(buffer, 0)
        header = json.loads(bytes(buffer[LENGTH.size:LENGTH.size + length]))
        start = _aligned(LENGTH.size + length)
        record = {}
        for name, dtype, shape, at in header["a"]:
            dtype = storage_dtype(dtype)
            count = int(np.prod(shape, dtype=np.int64))
            record[name] = np.frombuffer(buffer, dtype=dtype, count=count, offset=start + at).reshape(shape)
        record.update({name: _scalar(value) for name, value in header["s"].items()})
    except (struct.error, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"its payload does not decode ({type(exc).__name__}: {exc})") from None
    return record


CANONICAL_NAN = struct.pack(">d", float("nan"))


def _json_scalar(value):
    """A scalar as the header's JSON holds it: a NaN whose bits are not the canonical NaN's (a payload, a sign)
    as {"nan": its 8 bytes in hex}, which JSON's NaN would lose; everything else as it is.
    """
    if isinstance(value, float) and value != value and (bits := struct.pack(">d", value)) != CANONICAL_NAN:
        return {"nan": bits.hex()}
    return value


def _scalar(value):
    """A header scalar as the record holds it (the inverse of `_json_scalar`)."""
    return struct.unpack(">d", bytes.fromhex(value["nan"]))[0] if isinstance(value, dict) else value


def as_field(value, name, index: int = 0):
    """A record field as stored: a numpy array, or a JSON scalar; torch tensors become arrays."""
    if type(value).__module__.startswith("torch") and hasattr(value, "detach"):
        value = _tensor_array(value)
    if isinstance(value, np.ndarray):
        if value.dtype.hasobject or value.dtype.names is not None:
            raise InputError(f"record {index:,} field {name!r} is an array of dtype {value.dtype}; record "
                             f"shards hold plain numeric arrays: convert it (e.g. np.asarray(x, float32))")
        return value
    if isinstance(value, np.generic):
        _refuse_wide_scalar(value, name, index)
        value = value.item()
    if isinstance(value, SCALAR_TYPES):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    raise InputError(f"record {index:,} field {name!r} is a {type(value).__name__}; a record holds numpy "
                     f"arrays (or torch tensors) and int/float/bool/str/None scalars: convert it "
                     f"(lists: np.asarray(value))")


def _refuse_wide_scalar(value, name, index: int) -> None:
    """InputError for a numpy scalar wider than a float64 (long double: 80 or 128 bits): a scalar field is a JSON
    number, a float64, and would round it; a 0-d array keeps every bit.
    """
    if value.dtype.kind in "fc" and value.dtype.itemsize > (8 if value.dtype.kind == "f" else 16):
        raise InputError(f"record {index:,} field {name!r} is a numpy {value.dtype} scalar ({value!r}), which a "
                         f"scalar field would round to a float64: store it as a 0-d array (np.asarray(value)) "
                         f"to keep its bits, or as float(value)")


def _tensor_array(tensor) -> np.ndarray:
    """A torch tensor's bytes as a numpy array (bf16 as ml_dtypes' bfloat16: the same bits)."""
    tensor = tensor.detach().cpu()
    if str(tensor.dtype) == "torch.bfloat16":
        import torch

        return tensor.view(torch.int16).numpy().view(bfloat16())
    try:
        return tensor.numpy()
    except (TypeError, RuntimeError, NotImplementedError) as exc:   # float8, complex32, int4: numpy has no such type
        raise InputError(f"a torch tensor of {tensor.dtype} has no numpy array ({str(exc).splitlines()[0]}); "
                         f"store it as another dtype (x.to(torch.float16)) or its bits (x.view(torch.uint8))") from None


def dtype_code(dtype: np.dtype) -> str:
    """How a payload header and the schema name a dtype: its `str` ('<f2'), "bfloat16", or "ml_dtypes.NAME"
    for ml_dtypes' other types (float8, int4...), whose `str` ('<V1', '<f1') numpy cannot read back.
    """
    if dtype.type.__module__.startswith("ml_dtypes"):
        return "bfloat16" if dtype.name == "bfloat16" else f"ml_dtypes.{dtype.name}"
    return dtype.str


def field_schema(record: dict) -> dict:
    """{field: {"kind": "array", "dtype", "ndim"} or {"kind": "scalar"}}: what every record must match."""
    schema = {}
    for name, value in record.items():
        value = as_field(value, name)
        schema[str(name)] = ({"kind": "array", "dtype": dtype_code(value.dtype), "ndim": value.ndim}
                             if isinstance(value, np.ndarray) else {"kind": "scalar"})
    return dict(sorted(schema.items()))


def check_schema(record: dict, schema: dict, index: int) -> None:
    """InputError naming the record and field when `record` does not have the fields of `schema`."""
    if sorted(map(str, record)) != list(schema):
        raise InputError(f"record {index:,} has fields {sorted(map(str, record))}, the first record has "
                         f"{list(schema)}: every record needs the same fields (shapes may differ)")
    for name, want in schema.items():
        value = record[name]
        is_array = isinstance(value, np.ndarray) or (hasattr(value, "detach") and hasattr(value, "dtype"))
        if (want["kind"] == "array") != is_array:
            raise InputError(f"record {index:,} field {name!r} is a {type(value).__name__}; in the first "
                             f"record it is {'an array' if want['kind'] == 'array' else 'a scalar'}")
        if is_array:
            value = as_field(value, name, index)
            if (dtype_code(value.dtype), value.ndim) != (want["dtype"], want["ndim"]):
                raise InputError(f"record {index:,} field {name!r} is {value.dtype} with {value.ndim} "
                                 f"dims; the first record's is {storage_dtype(want['dtype'])} with "
                                 f"{want['ndim']}: cast it to one dtype (shapes may differ)")


def array_shapes(payload: bytes) -> dict[str, list[int]]:
    """{array field: shape} read from a payload's header (no array is decoded)."""
    (length,) = LENGTH.unpack_from(payload, 0)
    header = json.loads(payload[LENGTH.size:LENGTH.size + length])
    return {name: shape for name, _dtype, shape, _at in header["a"]}


def _stored_as_is(payload):
    """The raw codec: the payload is what is stored (no copy of a record of gigabytes)."""
    return payload


@functools.lru_cache(maxsize=8)
def record_coder(codec: str, level: int | None):
    """(compress, decompress) of a codec ("zstd" at `level`, or "raw"); built once per process."""
    if codec == "raw":
        return _stored_as_is, bytearray  # a bytearray decodes without another copy (decode_record)
    if codec != "zstd":
        raise ValueError(codec)
    import zstandard

    # no frame checksum: the shard's xxh3 table checks every stored record
    compressor = zstandard.ZstdCompressor(level=level or ZSTD_LEVEL, write_checksum=False)
    decompressor = zstandard.ZstdDecompressor()

    def decompress(blob) -> bytearray:
        """Straight into the bytearray the record is decoded from (no second copy of a large record)."""
        out = bytearray(zstandard.frame_content_size(blob))
        with decompressor.stream_reader(blob) as reader, memoryview(out) as view:
            filled = 0
            while filled < len(out):
                n = reader.readinto(view[filled:])
                if not n:
                    raise ValueError(f"the frame holds {filled:,} of the {len(out):,} bytes it declares")
                filled += n
        return out

    return compressor.compress, decompress


# ====================================================================================== shards


def record_shard_name(index: int) -> str:
    """The file name of record shard `index`: shard-00042.rec."""
    return f"shard-{index:05d}{SHARD_SUFFIX}"


class RecordShardWriter(SealedShard):
    """Stream one record shard (a `SealedShard`) to a temporary file beside its name; `commit` makes it durable.

    Stored records go straight to disk (RAM: the offsets and checksums, 16 bytes a record), so
    many writers may be open at once (one per group key). `commit` appends the tables and the
    trailer, fsyncs, renames and returns the manifest entry.
    """

    def __init__(self, folder: str | Path, index: int, key, codec: str):
        self.index, self.key, self.codec = index, key, codec
        self.raw_bytes = 0
        self.max_shapes: dict[str, list[int]] = {}
        super().__init__(Path(folder) / record_shard_name(index),
                         HEADER.pack(SHARD_MAGIC, codec.encode().ljust(4, b"\0"), *RECORD_SHAPE),
                         source=True, background_hash=False)

    @property
    def count(self) -> int:
        return len(self.sizes)

    @property
    def source_xxh3(self) -> str:
        """xxh3 of the payloads added so far (what a resume compares the input against)."""
        return self._source.hexdigest()

    def add(self, stored: bytes, payload: bytes) -> None:
        """Append one stored record (and feed its payload to the source hash and the shapes)."""
        super().add(stored, payload)
        self.raw_bytes += len(payload)
        for name, shape in array_shapes(payload).items():
            old = self.max_shapes.get(name)
            self.max_shapes[name] = list(shape) if old is None else [max(a, b) for a, b in zip(old, shape)]

    def commit(self, expect_sha256: str | None = None) -> dict:
        """Write the tables and trailer, fsync and rename; the shard's manifest entry."""
        entry = self.seal(expect_sha256, "zstandard or numpy changed how these records are stored since the "
                                         "shards were written; rebuild")
        return {**entry, "index": self.index, "key": self.key, "raw_bytes": self.raw_bytes,
                "max_shapes": dict(sorted(self.max_shapes.items()))}


# ====================================================================================== manifest


def read_record_manifest(folder: str | Path) -> dict:
    """The manifest body of the record shards at `folder`; CacheError when missing, damaged or foreign."""
    return read_shards_manifest(folder, MANIFEST_KIND, MANIFEST_VERSION, "these record shards",
                                f"it holds no record shards (yet); build them with python -m nblib cache "
                                f"--records FILE --out {folder}")


def write_record_manifest(folder: str | Path, body: dict) -> None:
    """Write the manifest atomically, shards in index order; seq is the number of shards listed."""
    body["shards"].sort(key=lambda s: s["index"])
    write_manifest(Path(folder) / MANIFEST, MANIFEST_KIND, body, version=MANIFEST_VERSION,
                   seq=len(body["shards"]))


def is_record_folder(folder: str | Path) -> bool:
    """True when `folder` holds a manifest of record shards (whatever its state)."""
    try:
        return json.loads((Path(folder) / MANIFEST).read_bytes()).get("kind") == MANIFEST_KIND
    except (OSError, ValueError, AttributeError):
        return False


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN
