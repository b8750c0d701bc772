"""Standard formats out: a cache, or an encode run's outputs, to Parquet or an HF `datasets` folder.

`export_cache(cache_dir, out, fmt)` writes one file per cache shard (one Parquet row group per
shard, zstd; or one Arrow file per shard in the layout `datasets.save_to_disk` writes), columns
`index` and `image`. In Parquet an array row is one fixed-size binary value (shape and dtype in
the schema metadata, `read_parquet_column` decodes it): a nested list column writes ~12x slower
(a repetition level per value) for no fewer bytes. `export_outputs(outputs_dir, out, fmt,
texts=...)` writes an encode run's consolidated outputs (sketches, checksums, children)
row-aligned with the texts (columns `index`, `text` when given, and one per output). In the HF
folder images are channel-first `datasets.Array3D` of shape (3, H, W): the obvious (H, W, 3)
layout makes Arrow keep one 4-byte list offset per 3-byte pixel, 2.34x the raw bytes (measured
at 224 px, against 1.02x channel-first); Parquet rows hold the same (3, H, W) bytes.

Every file goes through `nblib.atomic` and an export manifest (`nblib.manifest`, kind
"nblib.export") is rewritten after each one, so a killed export resumes at the first file the
manifest lacks; the HF folder's `state.json` and `dataset_info.json` are written last, so
`datasets.load_from_disk` never sees half an export. Reading back needs only pyarrow (Parquet,
Arrow IPC stream) or `datasets`.
"""
from __future__ import annotations

import io
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nblib.atomic import atomic_write_bytes, json_bytes, remove_temporaries, sha256_json
from nblib.errors import ConfigError, InputError, ManifestDamaged, StateError
from nblib.manifest import read_manifest, write_manifest
from nblib.units import fmt_bytes

FORMATS = ("parquet", "hf")
MANIFEST = "_nblib-export.json"  # "_": pyarrow and datasets skip it when reading the folder
KIND = "nblib.export"
ROWS_TARGET_BYTES = 128 * 1024 * 1024  # an outputs file holds about this many bytes of arrays


@dataclass(frozen=True)
class ExportSummary:
    """What an export wrote: files, rows, bytes, and how many files a resumed run reused."""

    out: str
    fmt: str
    n_rows: int
    n_files: int
    files_written: int
    files_reused: int
    bytes_on_disk: int

    def __str__(self) -> str:
        return (f"export {self.out} ({self.fmt}): {self.n_rows:,} rows in {self.n_files} files, "
                f"{fmt_bytes(self.bytes_on_disk)}; this run wrote {self.files_written} and reused "
                f"{self.files_reused}")


def export_cache(cache_dir: str | Path, out: str | Path, fmt: str = "parquet", *,
                 overwrite: bool = False) -> ExportSummary:
    """Export a cache's images (checked as read) to Parquet or an HF datasets folder, shard by shard."""
    from nblib.cache import ShardedImageCache

    check_format(fmt)
    cache = ShardedImageCache(cache_dir)
    h, w, c = cache.shape
    features = {"index": ("int64", None), "image": ("uint8", (c, h, w))}
    shards = cache.manifest["shards"]

    def table(k: int):
        entry = shards[k]
        images = cache.get_batch(entry["start"], entry["stop"]).transpose(0, 3, 1, 2)
        cache.close(k)
        return {"index": np.arange(entry["start"], entry["stop"], dtype=np.int64), "image": images}

    identity = {"what": "cache", "fingerprint": cache.fingerprint, "fmt": fmt,
                "rows": [[s["start"], s["stop"]] for s in shards]}
    return _export(Path(out), fmt, identity, features, len(shards), table, overwrite)


def export_outputs(outputs_dir: str | Path, out: str | Path, fmt: str = "parquet", *, texts=None,
                   field: str | None = None, overwrite: bool = False) -> ExportSummary:
    """Export an encode run's consolidated outputs, row-aligned with `texts` (a path or a list), if given."""
    from nblib.encode.consolidate import load_outputs, read_index

    check_format(fmt)
    arrays = load_outputs(outputs_dir)
    if not arrays:
        raise StateError(f"{outputs_dir} holds no consolidated outputs to export; run encode first")
    n = len(next(iter(arrays.values())))
    text_list = _texts(texts, field, n) if texts is not None else None
    features = {"index": ("int64", None), **({"text": ("string", None)} if text_list is not None else {}),
                **{name: (str(a.dtype), tuple(a.shape[1:])) for name, a in arrays.items()}}
    row_bytes = sum(int(np.prod(a.shape[1:])) * a.itemsize for a in arrays.values()) or 1
    rows = max(1, ROWS_TARGET_BYTES // row_bytes)
    ranges = [(s, min(n, s + rows)) for s in range(0, n, rows)]

    def table(k: int):
        start, stop = ranges[k]
        columns = {"index": np.arange(start, stop, dtype=np.int64)}
        if text_list is not None:
            columns["text"] = text_list[start:stop]
        return {**columns, **{name: np.asarray(a[start:stop]) for name, a in arrays.items()}}

    index = read_index(outputs_dir) or {}
    digests = {name: index.get("files", {}).get(name, {}).get("sha256") for name in arrays}
    identity = {"what": "outputs", "outputs": digests, "fmt": fmt, "rows": ranges,
                "texts": sha256_json(text_list) if text_list is not None else None}
    return _export(Path(out), fmt, identity, features, len(ranges), table, overwrite)


def layout_bytes(images: np.ndarray) -> dict[str, float]:
    """Arrow bytes of uint8 [n, H, W, 3] images stored as Array3D, per layout, as a multiple of the raw bytes.

    {"hwc": ..., "chw": ...}: the channel-last layout pays a 4-byte list offset per 3-byte pixel.
    """
    images = np.asarray(images, dtype=np.uint8)
    n, h, w, c = images.shape
    out = {}
    for name, array, shape in (("hwc", images, (h, w, c)), ("chw", images.transpose(0, 3, 1, 2), (c, h, w))):
        table = _arrow_table({"image": np.ascontiguousarray(array)}, _hf_features({"image": ("uint8", shape)}))
        out[name] = len(_encode("hf", table)) / images.nbytes
    return out


def read_parquet_column(path: str | Path, column: str) -> np.ndarray:
    """One array column of an exported Parquet file or folder as a numpy array (pyarrow only).

    Array rows are fixed-size binary values; their shape and dtype are in the file's schema
    metadata ("nblib.arrays"): np.frombuffer(value, dtype).reshape(shape) is one row.
    """
    import pyarrow.parquet as pq

    path = Path(path)
    files = sorted(path.glob("*.parquet")) if path.is_dir() else [path]
    parts = []
    for f in files:
        table = pq.read_table(f, columns=[column])
        described = json.loads((table.schema.metadata or {}).get(b"nblib.arrays", b"{}")).get(column)
        array = table.column(0).combine_chunks()
        if described is None:
            parts.append(_to_numpy(array))
            continue
        dtype, shape = np.dtype(described["dtype"]), described["shape"]
        row = int(np.prod(shape)) * dtype.itemsize
        flat = np.frombuffer(array.buffers()[1], dtype=np.uint8, count=(array.offset + len(array)) * row)
        parts.append(flat[array.offset * row:].view(dtype).reshape(len(array), *shape))
    return np.concatenate(parts)


def read_export(folder: str | Path) -> dict:
    """Every column of an export, read back: with `datasets.load_from_disk` for an HF folder, with
    pyarrow alone for Parquet. Array columns come back as numpy arrays, text as a list of str.
    """
    folder = Path(folder)
    if (folder / "state.json").exists():
        import datasets

        dataset = datasets.load_from_disk(str(folder))
        out = {}
        for name, feature in dataset.features.items():
            column = dataset.data.table.column(name)
            if getattr(feature, "shape", None) is not None:
                out[name] = _to_numpy(column).astype(feature.dtype)
            elif getattr(feature, "dtype", None) == "string":
                out[name] = column.to_pylist()
            else:
                out[name] = column.to_numpy()
        return out
    import pyarrow.parquet as pq

    names = pq.read_schema(sorted(folder.glob("*.parquet"))[0]).names
    out = {}
    for name in names:
        values = read_parquet_column(folder, name)
        out[name] = values.tolist() if values.dtype == object else values
    return out


def check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ConfigError(f"export format {fmt!r} is not one of {FORMATS}")


# ====================================================================================== helpers


def _export(out: Path, fmt: str, identity: dict, features: dict, n_files: int,
            table: Callable[[int], dict], overwrite: bool) -> ExportSummary:
    """Write files 0..n_files-1 that the export manifest lacks; then the HF metadata; the summary."""
    if out.exists() and not out.is_dir():
        raise InputError(f"{out} is a file, not a folder: an export needs a folder; pass another --out")
    out.mkdir(parents=True, exist_ok=True)
    manifest = _open_manifest(out, identity, overwrite)
    remove_temporaries(out)
    hf = _hf_features(features)
    written = 0
    for k in range(n_files):
        name = _file_name(fmt, k, n_files)
        listed = manifest["files"].get(name)
        if listed and _intact(out / name, listed):
            continue
        columns = table(k)
        data = _encode(fmt, _arrow_table(columns, hf) if fmt == "hf" else _parquet_table(columns, features))
        result = atomic_write_bytes(out / name, data)
        manifest["files"][name] = {"bytes": result.bytes, "sha256": result.sha256}
        write_manifest(out / MANIFEST, KIND, manifest, seq=len(manifest["files"]))
        written += 1
    if fmt == "hf":
        _write_hf_metadata(out, hf, [_file_name(fmt, k, n_files) for k in range(n_files)], identity)
    n_rows = sum(stop - start for start, stop in identity["rows"])
    on_disk = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    return ExportSummary(str(out), fmt, n_rows, n_files, written, n_files - written, on_disk)


def _open_manifest(out: Path, identity: dict, overwrite: bool) -> dict:
    try:
        record = read_manifest(out / MANIFEST, KIND)
    except ManifestDamaged:
        record = None  # torn or edited: start over, every file is checked against nothing
    if record is not None and record.body.get("identity") == identity:
        return record.body
    if record is not None and not overwrite:
        raise StateError(f"{out} holds an export of something else ({record.body.get('identity', {}).get('what')}, "
                         f"other rows or format); pass overwrite=True (--overwrite) or another --out")
    for path in out.iterdir():
        if path.is_file() and (path.suffix in (".parquet", ".arrow") or path.name in
                               (MANIFEST, "state.json", "dataset_info.json")):
            path.unlink()
    body = {"identity": identity, "files": {}}
    write_manifest(out / MANIFEST, KIND, body)
    return body


def _intact(path: Path, listed: dict) -> bool:
    """True when a listed file is there with its recorded size (a resume trusts size; verify hashes)."""
    try:
        return path.stat().st_size == listed["bytes"]
    except FileNotFoundError:
        return False


def _file_name(fmt: str, k: int, n: int) -> str:
    return f"data-{k:05d}-of-{n:05d}." + ("parquet" if fmt == "parquet" else "arrow")


def _hf_features(features: dict):
    """datasets.Features for {column: (dtype, shape or None)}: Value, or Array2D..Array5D."""
    import datasets

    kinds = {2: datasets.Array2D, 3: datasets.Array3D, 4: datasets.Array4D, 5: datasets.Array5D}
    out = {}
    for name, (dtype, shape) in features.items():
        if not shape:
            out[name] = datasets.Value(dtype)
        elif len(shape) == 1:
            out[name] = datasets.Sequence(datasets.Value(dtype), length=shape[0])
        elif len(shape) in kinds:
            out[name] = kinds[len(shape)](shape=tuple(shape), dtype=dtype)
        else:
            raise InputError(f"column {name} has {len(shape)} dimensions per row; export takes up to 5")
    return datasets.Features(out)


def _arrow_table(columns: dict, features):
    """The Arrow table `datasets` builds for these columns (its schema and metadata), built without copies.

    Fixed-shape arrays become nested list arrays over one flat buffer (offsets only), wrapped in
    the datasets extension type; `datasets.Dataset.from_dict` would convert row by row (~50x slower).
    """
    import pyarrow as pa

    schema = features.arrow_schema
    arrays = [_arrow_column(columns[name], features[name], schema.field(name).type) for name in schema.names]
    return pa.Table.from_arrays(arrays, schema=schema)


def _arrow_column(values, feature, arrow_type):
    import pyarrow as pa

    if not isinstance(values, np.ndarray) or values.ndim == 1:
        return pa.array(values.tolist() if isinstance(values, np.ndarray) else list(values), type=arrow_type)
    array = np.ascontiguousarray(values)
    if str(array.dtype) != getattr(feature, "dtype", None) and hasattr(feature, "dtype"):
        array = array.astype(feature.dtype)
    flat = pa.Array.from_buffers(pa.from_numpy_dtype(array.dtype), array.size, [None, pa.py_buffer(array)])
    if array.ndim == 2:  # Sequence(length=k): a fixed-size list
        return pa.FixedSizeListArray.from_arrays(flat, array.shape[1])
    nested = flat
    for depth in range(array.ndim - 1, 0, -1):
        rows = int(np.prod(array.shape[:depth]))
        offsets = pa.array(np.arange(rows + 1, dtype=np.int32) * array.shape[depth])
        nested = pa.ListArray.from_arrays(offsets, nested)
    return pa.ExtensionArray.from_storage(arrow_type, nested)


def _parquet_table(columns: dict, features: dict):
    """Parquet's table: each fixed-shape array row as one fixed-size binary value (C order), shapes
    and dtypes in the schema metadata ("nblib.arrays"). A nested Array3D column writes ~12x slower
    (Parquet stores a repetition level per value) for no fewer bytes.
    """
    import pyarrow as pa

    arrays, described = {}, {}
    for name, (dtype, shape) in features.items():
        values = columns[name]
        if shape and len(shape) >= 1:
            array = np.ascontiguousarray(values, dtype=dtype)
            kind = pa.binary(int(np.prod(shape)) * array.itemsize)
            arrays[name] = pa.FixedSizeBinaryArray.from_buffers(kind, len(array), [None, pa.py_buffer(array)])
            described[name] = {"shape": list(shape), "dtype": dtype}
        else:
            arrays[name] = pa.array(values.tolist() if isinstance(values, np.ndarray) else list(values),
                                    type=pa.string() if dtype == "string" else pa.from_numpy_dtype(np.dtype(dtype)))
    table = pa.table(arrays)
    return table.replace_schema_metadata({"nblib.arrays": json.dumps(described, sort_keys=True)})


def _encode(fmt: str, table) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    buffer = io.BytesIO()
    if fmt == "parquet":
        pq.write_table(table, buffer, compression="zstd", row_group_size=max(1, table.num_rows))
    else:
        with pa.ipc.new_stream(buffer, table.schema) as writer:
            writer.write_table(table)
    return buffer.getvalue()


def _write_hf_metadata(out: Path, features, files: list[str], identity: dict) -> None:
    """dataset_info.json and state.json as `datasets.save_to_disk` writes them (last, atomically)."""
    import datasets

    info = io.BytesIO()
    datasets.DatasetInfo(features=features)._dump_info(info, pretty_print=True)
    atomic_write_bytes(out / "dataset_info.json", info.getvalue())
    state = {"_data_files": [{"filename": name} for name in files],
             "_fingerprint": sha256_json(identity)[:16], "_format_columns": None, "_format_kwargs": {},
             "_format_type": None, "_output_all_columns": False, "_split": None}
    atomic_write_bytes(out / "state.json", json_bytes(state))


def _texts(texts, field: str | None, n: int) -> list[str]:
    from nblib.cache.texts import text_source

    text_list = list(text_source(texts, field, "strict"))
    if len(text_list) != n:
        raise InputError(f"{len(text_list):,} texts for {n:,} output rows: pass the texts the run encoded "
                         f"(the cache's --texts), in the same order")
    return text_list


def _to_numpy(column) -> np.ndarray:
    """A fixed-shape nested-list (or datasets extension) Arrow column as a numpy array."""
    import pyarrow as pa

    if hasattr(column, "combine_chunks"):
        column = column.combine_chunks()
    if isinstance(column.type, pa.ExtensionType):
        column = column.storage
    shape = []
    values = column
    while pa.types.is_list(values.type) or pa.types.is_fixed_size_list(values.type) \
            or pa.types.is_large_list(values.type):
        lengths = values.value_lengths().unique().to_pylist() if len(values) else [0]
        if len(lengths) != 1:
            raise StateError("the column's rows do not all have one shape")
        shape.append(lengths[0])
        values = values.flatten()
    return values.to_numpy(zero_copy_only=False).reshape(len(column), *shape)
