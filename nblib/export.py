"""Standard formats out: a cache, or an encode run's outputs, to Parquet or an HF `datasets` folder.

`export_cache` writes one file per cache shard, rows carrying `index` and the image's `text` or `key`;
`export_outputs` writes an encode run's outputs row-aligned with the texts. The layouts (raw image
blobs beside `height`/`width`/`channels` in Parquet, channel-first `Array3D` in the HF folder, and
why), the staging folder and the completion record that keep half an export from any reader, and
what a folder must hold before an export writes there: docs/formats.md and docs/failures.md. One
export at a time holds the folder's lock (`nblib.lock`), and each data file carries its export's
digest in its schema metadata, so `read_export` refuses files copied in from another export.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nblib.atomic import atomic_write_bytes, fsync_dir, json_bytes, remove_temporaries, sha256_json
from nblib.errors import ConfigError, InputError, ManifestDamaged, StateError
from nblib.lock import LOCK_PREFIX, FolderLock, run_identity
from nblib.manifest import manifest_bytes, read_manifest
from nblib.units import fmt_bytes

FORMATS = ("parquet", "hf")
MANIFEST = "_nblib-export.json"  # "_": pyarrow and datasets skip it when reading the folder
STAGING = ".nblib-staging"       # files not yet in place: hidden, and named *.part
KIND = "nblib.export"
VERSION = 3                      # 3: each file carries its export's digest; 2: staging, completion record
STAMP = b"nblib.export"          # schema metadata key of every data file: sha256 of its export's identity
HF_METADATA = ("dataset_info.json", "state.json")
READABLE = re.compile(r".*\.(parquet|arrow)$|^state\.json$|^dataset_info\.json$")
OURS = re.compile(r"^data-\d{5}-of-\d{5}\.(parquet|arrow)$")
ROWS_TARGET_BYTES = 128 * 1024 * 1024  # an outputs file holds about this many bytes of arrays
ZSTD_LEVELS = (1, 22)


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


def export_cache(cache_dir: str | Path, out: str | Path, fmt: str = "parquet", *, texts=None,
                 field: str | None = None, compression_level: int | None = None,
                 overwrite: bool = False) -> ExportSummary:
    """Export a cache's images (checked as read) with their texts or source keys, shard by shard.

    A cache rendered from texts carries them in a `text` column: read from the path its manifest
    records, or from `texts` (a path or a list) when it was built from a list or the file moved;
    they must be the texts it was rendered from. A cache of image files carries their names (`key`).
    """
    from nblib.cache import ShardedImageCache

    check_format(fmt)
    level = check_level(fmt, compression_level)
    cache = ShardedImageCache(cache_dir)
    h, w, c = cache.shape
    labels = _cache_labels(cache, texts, field)
    features = {"index": ("int64", None), **{name: ("string", None) for name in labels},
                "image": ("uint8", (c, h, w) if fmt == "hf" else (h, w, c))}
    shards = cache.manifest["shards"]

    def table(k: int):
        entry = shards[k]
        images = cache.get_batch(entry["start"], entry["stop"])
        cache.close(k)
        rows = slice(entry["start"], entry["stop"])
        return {"index": np.arange(entry["start"], entry["stop"], dtype=np.int64),
                **{name: values[rows] for name, values in labels.items()},
                "image": images.transpose(0, 3, 1, 2) if fmt == "hf" else images}

    identity = {"what": "cache", "fingerprint": cache.fingerprint, "fmt": fmt, "level": level,
                "rows": [[s["start"], s["stop"]] for s in shards],
                "labels": {name: sha256_json(values) for name, values in labels.items()}}
    command = ["--cache", str(Path(cache_dir).resolve()), *_flags(fmt, level, texts, field)]
    return _export(Path(out), fmt, identity, features, len(shards), table, overwrite, command, level)


def export_outputs(outputs_dir: str | Path, out: str | Path, fmt: str = "parquet", *, texts=None,
                   field: str | None = None, compression_level: int | None = None,
                   overwrite: bool = False) -> ExportSummary:
    """Export an encode run's consolidated outputs, row-aligned with `texts` (a path or a list), if given."""
    from nblib.cache.texts import text_source
    from nblib.encode.consolidate import load_outputs, read_index

    check_format(fmt)
    level = check_level(fmt, compression_level)
    arrays = load_outputs(outputs_dir)
    if not arrays:
        raise StateError(f"{outputs_dir} holds no consolidated outputs to export; run encode first")
    n = len(next(iter(arrays.values())))
    text_list = None if texts is None else list(text_source(texts, field, "strict"))
    if text_list is not None and len(text_list) != n:
        raise InputError(f"{len(text_list):,} texts for {n:,} output rows: pass the texts the run encoded "
                         f"(the cache's --texts), in the same order")
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
    identity = {"what": "outputs", "outputs": digests, "fmt": fmt, "rows": ranges, "level": level,
                "texts": sha256_json(text_list) if text_list is not None else None}
    command = ["--outputs", str(Path(outputs_dir).resolve()), *_flags(fmt, level, texts, field)]
    return _export(Path(out), fmt, identity, features, len(ranges), table, overwrite, command, level)


def layout_bytes(images: np.ndarray) -> dict[str, float]:
    """Arrow bytes of uint8 [n, H, W, 3] images stored as Array3D, per layout, as a multiple of the raw bytes.

    {"hwc": ..., "chw": ...}: the channel-last layout pays a 4-byte list offset per 3-byte pixel.
    """
    images = np.asarray(images, dtype=np.uint8)
    n, h, w, c = images.shape
    out = {}
    for name, array, shape in (("hwc", images, (h, w, c)), ("chw", images.transpose(0, 3, 1, 2), (c, h, w))):
        table = _arrow_table({"image": np.ascontiguousarray(array)}, _hf_features({"image": ("uint8", shape)}))
        out[name] = len(_encode("hf", table, None)) / images.nbytes
    return out


def read_parquet_column(path: str | Path, column: str) -> np.ndarray:
    """One column of an exported Parquet file or folder as a numpy array (pyarrow only).

    Array rows are fixed-size binary values; their shape and dtype are in the file's schema
    metadata ("nblib.arrays"): np.frombuffer(value, dtype).reshape(shape) is one row (an image's
    shape is also in its `height`, `width` and `channels` columns). A folder is read through its
    export manifest: only a complete export's files.
    """
    import pyarrow.parquet as pq

    path = Path(path)
    files = [path / name for name in _complete_body(path)["names"]] if path.is_dir() else [path]
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
    """Every column of a complete export, read back: with `datasets.load_from_disk` for an HF folder,
    with pyarrow alone for Parquet. Array columns come back as numpy arrays (a cache's images as
    [n, H, W, C] in both formats), text and keys as lists of str.

    StateError when the folder holds no nblib export, or an unfinished one (naming the files not in
    place and the command that finishes it).
    """
    folder = Path(folder)
    body = _complete_body(folder)
    if body["identity"]["fmt"] == "hf":
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
        if body["identity"]["what"] == "cache":
            out["image"] = out["image"].transpose(0, 2, 3, 1)
        return out
    import pyarrow.parquet as pq

    names = pq.read_schema(folder / body["names"][0]).names
    out = {}
    for name in names:
        values = read_parquet_column(folder, name)
        out[name] = values.tolist() if values.dtype == object else values
    return out


def check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ConfigError(f"export format {fmt!r} is not one of {FORMATS}")


def check_level(fmt: str, level: int | None) -> int | None:
    """The zstd level of a Parquet export (1-22; None: pyarrow's default); the HF folder takes none."""
    if level is None:
        return None
    if fmt != "parquet":
        raise ConfigError(f"--compression-level {level} applies to --format parquet; the HF folder is "
                          f"uncompressed Arrow, as datasets.save_to_disk writes it (drop the flag)")
    if not ZSTD_LEVELS[0] <= int(level) <= ZSTD_LEVELS[1]:
        raise ConfigError(f"--compression-level {level} is not a zstd level ({ZSTD_LEVELS[0]}-{ZSTD_LEVELS[1]}; "
                          f"19 gives ~0.45x the cache's bytes, slower)")
    return int(level)


# ====================================================================================== helpers


def _export(out: Path, fmt: str, identity: dict, features: dict, n_files: int, table: Callable[[int], dict],
            overwrite: bool, command: list[str], level: int | None) -> ExportSummary:
    """Stage files 0..n_files-1 that the manifest lacks, move them in place, record completion; the summary.

    All of it under the folder's lock: one export writes a folder at a time, or two would mix their files.
    """
    if out.exists() and not out.is_dir():
        raise InputError(f"{out} is a file, not a folder: an export needs a folder; pass another --out")
    with FolderLock(out, identity=run_identity(f"nblib.export:{sha256_json(identity)[:16]}"),
                    what="export folder", hint="pass another --out") as lock:
        names = [f"data-{k:05d}-of-{n_files:05d}.{'parquet' if fmt == 'parquet' else 'arrow'}" for k in range(n_files)]
        body = _open_manifest(out, identity, overwrite, names, command)
        body["command"] = command  # how to finish it, as last run (the inputs may have moved)
        remove_temporaries(out)
        hf = _hf_features(features)
        written, digest = 0, sha256_json(identity).encode()
        for k, name in enumerate(names):
            listed = body["files"].get(name)
            if listed and any(_intact(path, listed) and _read_stamp(path, fmt) == digest
                              for path in (out / name, _staged(out, name))):
                continue                # in place or staged, of this export: a file of another one is rewritten
            if body.get("complete"):
                body["complete"] = False  # a file is redone: not complete until it is in place again
                _write_manifest(out, body, seq=len(body["files"]))
            columns = table(k)
            stamped = _arrow_table(columns, hf) if fmt == "hf" else _parquet_table(columns, features)
            # the export's digest in the schema metadata (pyarrow, polars and datasets ignore it)
            stamped = stamped.replace_schema_metadata({**(stamped.schema.metadata or {}), STAMP: digest})
            data = _encode(fmt, stamped, level)
            result = atomic_write_bytes(_staged(out, name), data)
            body["files"][name] = {"bytes": result.bytes, "sha256": result.sha256}
            _write_manifest(out, body, seq=len(body["files"]))
            written += 1
        if not body.get("complete"):
            lock.check()
            _finish(out, body, fmt, hf, names, identity)
        n_rows = sum(stop - start for start, stop in identity["rows"])
        on_disk = sum(p.stat().st_size for p in out.iterdir() if p.is_file() and not p.name.startswith(LOCK_PREFIX))
        return ExportSummary(str(out), fmt, n_rows, n_files, written, n_files - written, on_disk)


def _finish(out: Path, body: dict, fmt: str, hf, names: list[str], identity: dict) -> None:
    """Every file is staged or in place: rename the staged ones in, write the HF metadata, then the
    completion record (the manifest with complete: true), last.
    """
    for name in names:
        staged = _staged(out, name)
        if staged.exists():
            os.replace(staged, out / name)
    fsync_dir(out)
    if fmt == "hf":
        _write_hf_metadata(out, hf, names, identity)
    body["complete"] = True
    _write_manifest(out, body, seq=len(names) + 1)
    with contextlib.suppress(OSError):
        (out / STAGING).rmdir()


def _open_manifest(out: Path, identity: dict, overwrite: bool, names: list[str], command: list[str]) -> dict:
    """The manifest to continue (same identity), or a fresh one after clearing what an older export of
    ours listed (overwrite); a folder of someone else's files is refused (see the module docstring).
    """
    try:
        record = read_manifest(out / MANIFEST, KIND, versions=(1, 2, VERSION))
        damaged = None
    except ManifestDamaged as exc:
        record, damaged = None, exc
    same = record is not None and record.version == VERSION and record.body.get("identity") == identity
    listed = set(record.body.get("files", {})) if record is not None else set()
    if record is not None and record.body.get("identity", {}).get("fmt") == "hf":
        listed |= set(HF_METADATA)  # ours, also when a kill came between them and the completion record
    if damaged is not None:
        listed = {p.name for p in out.iterdir() if OURS.match(p.name)} | set(HF_METADATA)
    _refuse_foreign(out, listed | {MANIFEST, STAGING}, record is not None or damaged is not None, overwrite)
    if same:
        return record.body
    if (record is not None or damaged is not None) and not overwrite:
        what = ("a damaged export manifest" if damaged is not None else
                f"an export of something else ({record.body.get('identity', {}).get('what')}, other rows, "
                f"format, level or texts{', or an older nblib' if record.version != VERSION else ''})")
        raise StateError(f"{out} holds {what}; pass overwrite=True (--overwrite) to replace it (this deletes "
                         f"only the {len(listed)} files that export wrote) or pick another --out")
    for name in listed:
        (out / name).unlink(missing_ok=True)
        _staged(out, name).unlink(missing_ok=True)
    body = {"identity": identity, "files": {}, "names": names, "command": command, "complete": False}
    _write_manifest(out, body, seq=0)
    return body


def _refuse_foreign(out: Path, ours: set[str], has_manifest: bool, overwrite: bool) -> None:
    """Refuse a folder holding files no export manifest of ours lists: always when a reader of the
    folder would take them for part of the export, else unless overwrite (they are then left alone).
    """
    foreign = sorted(p.name for p in out.iterdir()
                     if p.name not in ours and not p.name.startswith((".tmp-", LOCK_PREFIX)))
    readable = [name for name in foreign if READABLE.match(name)]
    if readable:
        shown = ", ".join(readable[:5]) + (" ..." if len(readable) > 5 else "")
        raise StateError(f"{out} holds {len(readable)} files that no nblib export wrote and that a reader of "
                         f"the folder would take for part of this export ({shown}); nblib never deletes "
                         f"them, --overwrite included: move them away, or pick another --out")
    if foreign and not has_manifest and not overwrite:
        shown = ", ".join(foreign[:5]) + (" ..." if len(foreign) > 5 else "")
        raise StateError(f"{out} is not empty and holds no nblib export ({len(foreign)} entries: {shown}); "
                         f"pick an empty or new --out, or pass --overwrite to write the export beside them "
                         f"(they are left untouched)")


def _complete_body(folder: Path) -> dict:
    """The manifest body of a complete export in `folder`; StateError saying what is missing and how to finish."""
    if not folder.is_dir():
        raise StateError(f"{folder} is not a folder; pass the folder an export wrote (--out)")
    try:
        record = read_manifest(folder / MANIFEST, KIND, versions=(VERSION,))
    except ManifestDamaged as exc:
        raise StateError(f"{folder}: {exc}; rerun the export with --overwrite to redo it") from None
    if record is None:
        held = sum(1 for _ in folder.iterdir())
        raise StateError(f"{folder} holds no nblib export (no {MANIFEST}; {held} entries): export there first "
                         f"(python -m nblib export --cache DIR --out {folder}), or read it with pyarrow")
    body = record.body
    if not body.get("complete"):
        missing = [name for name in body["names"]
                   if not (name in body["files"] and _intact(folder / name, body["files"][name]))]
        shown = ", ".join(missing[:4]) + (" ..." if len(missing) > 4 else "")
        raise StateError(f"{folder} holds an unfinished export: {len(missing)} of {len(body['names'])} files are "
                         f"not in place ({shown}) and it has no completion record; finish it with: "
                         f"{_command(folder, body)}")
    _refuse_mixed(folder, body)
    return body


def _refuse_mixed(folder: Path, body: dict) -> None:
    """StateError unless every file of the export carries the digest of the export its manifest records."""
    digest, fmt = sha256_json(body["identity"]).encode(), body["identity"]["fmt"]
    missing = [name for name in body["names"] if not (folder / name).is_file()]
    others = [name for name in body["names"] if name not in missing and _read_stamp(folder / name, fmt) != digest]
    for bad, what in ((missing, "are missing"), (others, "were written by another export than its manifest's")):
        if bad:
            shown = ", ".join(bad[:4]) + (" ..." if len(bad) > 4 else "")
            raise StateError(f"{folder} is not one whole export: {len(bad)} of {len(body['names'])} files ({shown}) "
                             f"{what}; its own command rewrites them: {_command(folder, body)}")


def _read_stamp(path: Path, fmt: str) -> bytes | None:
    """The export digest in a data file's schema metadata (None: no stamp, or not a file we can read)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if fmt == "parquet":
            schema = pq.read_schema(path)
        else:
            with pa.OSFile(str(path)) as f:
                schema = pa.ipc.open_stream(f).schema
    except (OSError, pa.ArrowInvalid):
        return None
    return (schema.metadata or {}).get(STAMP)


def _command(folder: Path, body: dict) -> str:
    """The command that (re)runs the export recorded in `body` into `folder`."""
    return shlex.join(["python", "-m", "nblib", "export", *map(str, body.get("command", [])), "--out", str(folder)])


def _flags(fmt: str, level: int | None, texts, field: str | None) -> list[str]:
    """The command's flags past its input: format, level, and the texts' path and field when a path."""
    path = isinstance(texts, (str, os.PathLike))
    return ["--format", fmt, *([] if level is None else ["--compression-level", str(level)]),
            *(["--texts", str(Path(texts).resolve())] if path else []), *(["--field", field] if field and path else [])]


def _staged(out: Path, name: str) -> Path:
    return out / STAGING / f"{name}.part"


def _write_manifest(out: Path, body: dict, seq: int) -> None:
    atomic_write_bytes(out / MANIFEST, manifest_bytes(KIND, body, version=VERSION, seq=seq))


def _cache_labels(cache, texts, field: str | None) -> dict[str, list[str]]:
    """{"text": [...]} for a cache rendered from texts; for one of images (a folder, a dataset, tars): their
    names ("key") and the labels ("label", the class name) and texts ("text") its side table carries; else {}.
    """
    from nblib.cache.images import source_keys
    from nblib.cache.sources import source_labels
    from nblib.cache.texts import source_fingerprint, text_source

    source = cache.manifest["source"]
    if "n_texts" not in source:
        keys = source_keys(cache.cache_dir)
        side = source_labels(cache.cache_dir) or {}
        columns = {"key": keys} if keys is not None else {}
        if "labels" in side:
            columns["label"] = [side["classes"][k] for k in side["labels"]]
        if "texts" in side:
            columns["text"] = list(side["texts"])
        return columns
    path = texts if texts is not None else source.get("path")
    if path is None:
        raise InputError(f"the cache at {cache.cache_dir} was rendered from an in-memory list of texts, so the "
                         f"export cannot carry them by itself: pass the same texts (texts=..., --texts PATH)")
    what = field if texts is not None else source.get("field")
    try:
        text_list = list(text_source(path, what, source.get("errors", "strict")))
    except (InputError, OSError) as exc:
        raise InputError(f"the texts of the cache at {cache.cache_dir} could not be read ({exc}); pass them "
                         f"with --texts PATH (texts=...)") from None
    if source_fingerprint(text_list) != source["sha256"]:
        raise InputError(f"these {len(text_list):,} texts are not the {source['n_texts']:,} the cache at "
                         f"{cache.cache_dir} was rendered from (their sha256 differs); pass those texts (--texts)")
    return {"text": text_list}


def _intact(path: Path, listed: dict) -> bool:
    """True when a listed file is there with its recorded size (a resume trusts size; verify hashes)."""
    try:
        return path.stat().st_size == listed["bytes"]
    except FileNotFoundError:
        return False


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
            if name == "image":  # the shape in plain columns: any reader reshapes without our metadata
                for axis, size in zip(("height", "width", "channels"), shape):
                    arrays[axis] = pa.array(np.full(len(array), size, dtype=np.int32))
        else:
            arrays[name] = pa.array(values.tolist() if isinstance(values, np.ndarray) else list(values),
                                    type=pa.string() if dtype == "string" else pa.from_numpy_dtype(np.dtype(dtype)))
    table = pa.table(arrays)
    return table.replace_schema_metadata({"nblib.arrays": json.dumps(described, sort_keys=True)})


def _encode(fmt: str, table, level: int | None) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    buffer = io.BytesIO()
    if fmt == "parquet":
        pq.write_table(table, buffer, compression="zstd", compression_level=level,
                       row_group_size=max(1, table.num_rows))
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
