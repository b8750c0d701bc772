"""Images in from where people keep them: a folder (class subfolders or a labels file), a saved HF
dataset, Parquet or Arrow files, webdataset tars.

`images_source` (`cache --images PATH [--labels FILE]`), `hf_source` (`--hf`: local only, a hub name
is refused) and `wds_source` (`--wds`: tars streamed member by member with `tarfile`, never
extracted; a tar cut short is refused) hand every image undecoded to `write_images`, which decodes it
by the one pixel policy (`nblib.cache.pixels`). What each source reads, and the side table
`source-labels.json` its labels or texts travel in: docs/formats.md. `labels_line` says which classes
were found and how many images each holds, or how this source gets labels (`train` needs them).
Trade-off: the side table is one JSON list (a few bytes a row; 10 M captions make a big file),
and a tar stream cannot be counted without reading it, so a wds cache has no disk preflight.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import stat as stat_mode
import tarfile
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from nblib.cache.labels import class_name, label_index, labels_and_classes, labels_from_file
from nblib.cache.pixels import EncodedImage
from nblib.errors import CacheError, InputError, one_line

WDS_IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")
WDS_USED = (*WDS_IMAGE_EXTENSIONS, "cls", "txt", "json")   # members read; any other is skipped, unread
SHOWN_CLASSES = 6                                           # class names a labels line shows
_UNLABELLED = {                                             # how each source gets labels, as advised
    "--images": "put each class's images in a subfolder (DIR/cat/*.jpg) and cache into a new --out, or "
                "pass --labels FILE (file,label rows) and rerun this command",
    "--hf": "pass --hf PATH --label-column COLUMN (a class column) instead",
    "--wds": "give each sample a .cls member (or a json 'label'), then cache into a new --out",
}
_BRACE = re.compile(r"\{([^{}]*)\}")
READ_DEADLINE_ENV = "NBLIB_READ_DEADLINE_S"
DEFAULT_READ_DEADLINE_S = 60.0
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp")


@dataclass
class ImageSource:
    """Images to cache, with their count (None when unknown), keys, and a side table filled as read."""
    images: Iterator
    count: int | None
    keys: list[str] | None = None
    labels: list = field(default_factory=list)
    texts: list = field(default_factory=list)
    classes: list[str] | None = None
    origin: str = ""            # where the labels came from: "subfolders", "--labels FILE", "column 'label'"
    unlabelled: str = ""        # without labels: how to add them

    def side(self) -> dict | None:
        """The side table once every image was read: {"labels", "classes"}, {"texts"}, both, or {}."""
        table = {}
        if self.labels:
            labels, classes = self.labels, self.classes
            if classes is None:                     # streamed (wds): checked as a whole once all came
                labels, classes = labels_and_classes(self.labels, None, "--wds")
            table.update(labels=[int(v) for v in labels], classes=list(classes))
        if self.texts:
            table["texts"] = [str(t) for t in self.texts]
        return table


def images_source(path: str | Path, column: str | None = None, labels: str | Path | None = None) -> ImageSource:
    """What `cache --images PATH [--labels FILE]` caches: a folder's images keyed by their path under
    it, labelled by their class subfolder or by `labels` (a CSV or JSON of file,label:
    `nblib.cache.labels`); a Parquet file's or HF folder's images (no keys, no labels).
    """
    folder = Path(path)
    saved = (folder / "dataset_info.json").exists() or (folder / "state.json").exists()   # an HF datasets folder
    if not folder.is_dir() or saved:
        if labels is not None:
            raise InputError(f"--labels names files of an image folder; {path} is not one: for a dataset's "
                             f"labels pass --hf {path} --label-column COLUMN")
        images, count = image_items(path, column)
        return ImageSource(images=iter(images), count=count, unlabelled=_UNLABELLED["--hf"])
    files, classes = folder_images(folder)
    source = ImageSource(images=encoded_files(files), count=len(files), keys=image_keys(folder, files),
                         unlabelled=_UNLABELLED["--images"])
    if labels is not None:
        source.labels, source.classes = labels_from_file(labels, source.keys, str(folder))
        source.origin = f"--labels {Path(labels).name}"
    elif classes is not None:                       # class subfolders, sorted by name as ImageFolder does
        source.classes = sorted(set(classes))
        lookup = {c: k for k, c in enumerate(source.classes)}
        source.labels = [lookup[c] for c in classes]
        source.origin = "subfolders"
    return source


def hf_source(path: str | Path, image_column: str = "image", *, label_column: str | None = None,
              text_column: str | None = None) -> ImageSource:
    """A saved HF dataset, a Parquet file or folder, or an Arrow file or folder, with its labels or texts."""
    if label_column and text_column:
        raise InputError("pass --label-column or --text-column, not both")
    local = Path(path)
    if not local.exists():
        raise InputError(f"--hf {path}: no such file or folder; nblib reads local datasets only (nothing "
                         f"downloads): save it first with datasets.load_dataset({str(path)!r})"
                         f".save_to_disk('DIR') and pass --hf DIR")
    saved = ("dataset_info.json", "state.json", "dataset_dict.json")
    if local.is_dir() and any((local / name).exists() for name in saved):
        return _saved_dataset(local, image_column, label_column, text_column)
    if local.is_file():
        if local.suffix not in (".parquet", ".arrow"):
            raise InputError(f"--hf {local} is a {local.suffix or 'suffix-less'} file; pass a .parquet or "
                             f".arrow file, a folder of them, or a save_to_disk folder")
        return _table_source([local], image_column, label_column, text_column)
    files = sorted(local.glob("*.parquet")) or sorted(local.glob("*.arrow"))
    if not files:
        raise InputError(f"--hf {local} holds no .parquet or .arrow files and is no save_to_disk folder")
    return _table_source(files, image_column, label_column, text_column)


def wds_source(pattern: str) -> ImageSource:
    """Webdataset tars named by `pattern` (brace-expanded: shards-{000..009}.tar), streamed."""
    paths = [Path(p) for p in expand_braces(str(pattern))]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise InputError(f"--wds {pattern}: {len(missing)} of its {len(paths)} tars are missing or not files "
                         f"({', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}); fix the pattern")
    source = ImageSource(images=iter(()), count=None, keys=[], origin="the samples' labels",
                         unlabelled=_UNLABELLED["--wds"])
    source.images = (_wds_sample(path, key, members, source)
                     for path in paths for key, members in _wds_samples(path))
    return source


def expand_braces(pattern: str) -> list[str]:
    """Brace expansion as the shell and webdataset do it: {000..009} (zero-padded ranges), {a,b}."""
    match = _BRACE.search(pattern)
    if not match:
        return [pattern]
    head, body, tail = pattern[: match.start()], match.group(1), pattern[match.end():]
    ranged = re.fullmatch(r"(\d+)\.\.(\d+)", body)
    if ranged:
        first, last = ranged.groups()
        width = len(first) if first.startswith("0") else 0
        step = 1 if int(last) >= int(first) else -1
        parts = [str(k).zfill(width) for k in range(int(first), int(last) + step, step)]
    else:
        parts = body.split(",")
    return [name for part in parts for name in expand_braces(head + part + tail)]


def labels_line(source: ImageSource, cache_dir: str | Path) -> str:
    """What `cache --images/--hf/--wds` prints of the labels its cache holds: the classes, where they came
    from and the images of each ("labels: 10 classes from subfolders (cat, dog, ...), 135-146 images
    each"), or, without labels, that `train` needs them and how this source gets them.
    """
    table = source_labels(cache_dir) or {}
    if "labels" not in table:
        texts = f" ({len(table['texts']):,} texts)" if "texts" in table else ""
        return f"labels: none{texts}; train needs labels: {source.unlabelled}"
    classes = table["classes"]
    counts = Counter(table["labels"])
    per_class = [counts.get(k, 0) for k in range(len(classes))]
    low, high = min(per_class), max(per_class)
    each = f"{low:,}" if low == high else f"{low:,}-{high:,}"
    shown = ", ".join(_shown(c) for c in classes[:SHOWN_CLASSES]) + (", ..." if len(classes) > SHOWN_CLASSES else "")
    return f"labels: {len(classes):,} classes from {source.origin} ({shown}), {each} images each"


def _shown(name: str, width: int = 24) -> str:
    name = name if name.isprintable() else repr(name)
    return name if len(name) <= width else name[: width - 3] + "..."


def source_labels(cache_dir: str | Path) -> dict | None:
    """The side table a cache carries ({"labels", "classes"} or {"texts"}), checked by its hash, or None."""
    from nblib.cache.format import read_cache_manifest

    recorded = read_cache_manifest(cache_dir)["source"].get("side")
    if not recorded:
        return None
    table = recorded_json(cache_dir, recorded)
    if "classes" in recorded:
        table["classes"] = recorded["classes"]      # the class names live in the manifest
    return table


# ====================================================================================== helpers


def _saved_dataset(folder: Path, image_column: str, label_column, text_column) -> ImageSource:
    import datasets

    dataset = datasets.load_from_disk(str(folder))
    if isinstance(dataset, datasets.DatasetDict):
        raise InputError(f"--hf {folder} is a DatasetDict of splits {list(dataset)}; pass one split's "
                         f"folder (e.g. --hf {folder / next(iter(dataset))})")
    wanted = [c for c in (image_column, label_column, text_column) if c]
    _check_columns(f"--hf {folder}", wanted, dataset.column_names)
    source = ImageSource(images=_dataset_rows(dataset, image_column), count=len(dataset),
                         origin=f"column {label_column!r}", unlabelled=_UNLABELLED["--hf"])
    if label_column:
        feature = dataset.features[label_column]
        names = getattr(feature, "names", None)
        source.labels, source.classes = labels_and_classes(dataset[label_column], names, f"--hf {folder}")
    elif text_column:
        source.texts = _texts(dataset[text_column], f"--hf {folder}")
    return source


def _table_source(files: list[Path], image_column: str, label_column, text_column) -> ImageSource:
    schemas = [_schema(f) for f in files]
    wanted = [c for c in (image_column, label_column, text_column) if c]
    for f, schema in zip(files, schemas):
        _check_columns(f"--hf {f}", wanted, schema.names)
    source = ImageSource(images=table_images(files, image_column), count=sum(_rows(f) for f in files),
                         origin=f"column {label_column!r}", unlabelled=_UNLABELLED["--hf"])
    if label_column:
        values = [v for f in files for v in _read_column(f, label_column)]
        source.labels, source.classes = labels_and_classes(values, _class_names(schemas[0], label_column),
                                                           f"--hf {files[0]}")
    elif text_column:
        source.texts = _texts([v for f in files for v in _read_column(f, text_column)], str(files[0]))
    return source


def _check_columns(where: str, wanted: list[str], names: list[str]) -> None:
    absent = [c for c in wanted if c not in names]
    if absent:
        raise InputError(f"{where} has no column {absent[0]!r}; its columns are {list(names)}: pass "
                         f"--image-column / --label-column / --text-column one of those")


def _texts(values: list, where: str) -> list[str]:
    if any(v is None for v in values):
        raise InputError(f"{where}: row {values.index(None):,} has no text (null); fill it (\"\" for none) "
                         f"or drop the row")
    return [str(v) for v in values]


def _schema(path: Path):
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_schema(path)
    return arrow_reader(path).schema


def _rows(path: Path) -> int:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows
    return sum(batch.num_rows for batch in arrow_reader(path))


def _read_column(path: Path, column: str) -> list:
    return [v for batch in column_batches(path, column) for v in batch.column(0).to_pylist()]


def _class_names(schema, column: str) -> list[str] | None:
    """ClassLabel names from the `huggingface` schema metadata that datasets writes, if any."""
    meta = (schema.metadata or {}).get(b"huggingface")
    try:
        feature = json.loads(meta)["info"]["features"][column]
    except (TypeError, ValueError, KeyError):
        return None
    return feature.get("names") if isinstance(feature, dict) else None


def _wds_samples(path: Path) -> Iterator[tuple[str, dict[str, bytes | None]]]:
    """(key, {extension: bytes}) of each sample of one tar, in order (members of a sample are adjacent).

    Only the members in WDS_USED are read; any other is skipped by a seek, never read (its value is
    None). A tar that ends without its end-of-archive blocks (cut between two members, or inside a
    header) is refused, as a tar cut inside a member is: no short cache from a short copy.
    """
    key, members, name = None, {}, None
    try:
        with tarfile.open(path, mode="r:*") as tar:
            for info in tar:
                if not info.isfile():
                    continue
                name = info.name
                folder, _, base = name.rpartition("/")
                stem, dot, ext = base.partition(".")
                if not dot:
                    continue
                this = f"{folder}/{stem}" if folder else stem
                if this != key and key is not None:
                    yield key, members
                    members = {}
                key, ext = this, ext.lower()
                members[ext] = tar.extractfile(info).read() if ext in WDS_USED else None
            if tar.fileobj.tell() < tar.offset + tarfile.BLOCKSIZE:  # no end-of-archive block came
                raise InputError(f"--wds {path} ends after member {name!r} without the tar's end-of-archive "
                                 f"blocks: it was cut (a short copy or download); re-download or rewrite that tar")
    except (tarfile.TarError, EOFError, OSError) as exc:
        after = f" after member {name!r}" if name else " at its start"
        raise InputError(f"--wds {path} is damaged{after} ({one_line(exc, 200)}); re-download or rewrite that "
                         f"tar") from None
    if key is not None:
        yield key, members


def _wds_sample(path: Path, key: str, members: dict[str, bytes], source: ImageSource):
    ext = next((e for e in WDS_IMAGE_EXTENSIONS if members.get(e) is not None), None)
    if ext is None:
        raise InputError(f"--wds {path}: sample {key!r} has no image member ({', '.join(WDS_IMAGE_EXTENSIONS)}); "
                         f"its members are {sorted(members)}")
    image = EncodedImage(members[ext], f"--wds {path} member {key}.{ext}")    # decoded by write_images
    label, text = _wds_annotation(path, key, members)
    n = len(source.keys)
    if n and ((label is not None) != (len(source.labels) == n) or (text is not None) != (len(source.texts) == n)):
        raise InputError(f"--wds {path}: sample {key!r} carries {'a label' if label is not None else 'no label'} "
                         f"and {'a text' if text is not None else 'no text'}, unlike the first sample; "
                         f"every sample needs the same annotations")
    source.keys.append(key)
    if label is not None:
        source.labels.append(label)
    if text is not None:
        source.texts.append(text)
    return image


def _wds_annotation(path: Path, key: str, members: dict[str, bytes]) -> tuple[int | None, str | None]:
    label = text = None
    extra = {}
    if "json" in members:
        try:
            extra = json.loads(members["json"])
        except ValueError as exc:
            raise InputError(f"--wds {path} member {key}.json is not JSON ({exc})") from None
        extra = extra if isinstance(extra, dict) else {}
    raw = members.get("cls", extra.get("label", extra.get("cls")))
    if raw is not None:
        try:
            label = int(raw.decode().strip() if isinstance(raw, bytes) else raw)
        except (ValueError, UnicodeDecodeError, TypeError):
            raise InputError(f"--wds {path} sample {key!r}: its label {raw!r} is not an integer class") from None
        label_index(label, f"--wds {path} sample {key!r}")  # checked as it comes: 10**12 is no class count
    raw = members.get("txt", extra.get("text", extra.get("caption")))
    if raw is not None:
        text = raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else str(raw)
    return label, text



# ====================================================================================== reading images


def recorded_json(cache_dir: str | Path, recorded: dict):
    """The JSON file a cache's manifest records ({"file", "sha256"}: its keys, its side table), checked by its hash."""
    path = Path(cache_dir) / recorded["file"]
    raw = path.read_bytes() if path.exists() else b""
    if hashlib.sha256(raw).hexdigest() != recorded["sha256"]:
        raise CacheError(f"{path} is missing or damaged (its sha256 differs from the manifest's); rerun "
                         f"the cache command that built {cache_dir} to rewrite it")
    return json.loads(raw)


def image_items(path: str | Path, column: str | None = None) -> tuple[Iterable, int]:
    """(items, count) of what `cache --images PATH` takes where PATH is no folder of image files (those
    `sources.images_source` lists with `folder_images`): a Parquet file (`column`, default "image") or an HF
    datasets folder (`save_to_disk`); images not yet decoded (`EncodedImage`): `write_images` decodes them by
    the one pixel policy (`nblib.cache.pixels`), knowing its `size`.
    """
    path, column = Path(path), column or "image"
    if not path.exists():
        raise InputError(f"--images {path} does not exist; pass a folder of images, a Parquet file or "
                         f"an HF datasets folder")
    if path.is_dir():
        import datasets

        dataset = datasets.load_from_disk(str(path))
        return dataset_column(dataset, column), len(dataset)
    if path.suffix != ".parquet":
        raise InputError(f"--images {path} is a {path.suffix or 'suffix-less'} file; pass a .parquet "
                         f"file, a folder of image files or an HF datasets folder")
    names = _schema(path).names
    if column not in names:
        raise InputError(f"{path} has no column {column!r}; its columns are {names}: pass --column")
    return table_images([path], column), _rows(path)


def encoded_files(files: list[Path]) -> Iterator[EncodedImage]:
    """Each file's bytes, read within the read deadline (a FIFO refused), as an `EncodedImage`."""
    deadline_s = read_deadline()
    return (EncodedImage(read_file_within(p, deadline_s), str(p)) for p in files)


def folder_images(folder: Path) -> tuple[list[Path], list[str] | None]:
    """(image files in cache order, the class of each or None) of a folder.

    A flat folder: its image files, sorted by name, no classes. A folder of class subfolders (the
    ImageFolder convention): the classes are the subfolders, sorted by name (`class_name`), each one's
    image files (nested folders too) sorted by path; names starting with "." or "__" are skipped. Refused
    in one line: images beside class subfolders, an empty class subfolder, and what docs/formats.md
    (class folders: one folder twice, a name not in UTF-8) and docs/failures.md (a FIFO) list.
    """
    top = sorted(p for p in folder.iterdir() if _wanted(p) and p.suffix.lower() in IMAGE_SUFFIXES)
    subs = sorted((p for p in folder.iterdir() if _wanted(p) and p.is_dir() and p not in top),
                  key=lambda p: (class_name(p.name), p.name))
    trees = {sub: _tree_files(sub) for sub in subs}
    if top and any(trees.values()):
        filled = [s.name for s, files in trees.items() if files]
        raise InputError(f"--images {folder} holds {len(top):,} image files beside {len(filled):,} subfolders of "
                         f"images ({', '.join(filled[:3])}): keep every image in a class subfolder (labels "
                         f"from the folder names) or all at the top (no labels), then rerun")
    if not top and subs:
        empty = [s.name for s, files in trees.items() if not files]
        if empty and len(empty) < len(subs):
            raise InputError(f"--images {folder}: the class subfolder {empty[0]!r} holds no image files "
                             f"({', '.join(IMAGE_SUFFIXES)}); add its images or move it out, then rerun")
        _one_folder_per_class(folder, [sub for sub in subs if trees[sub]])
        files = [p for sub in subs for p in trees[sub]]
        classes = [class_name(sub.name) for sub in subs for _ in trees[sub]]
        return _regular(folder, files), classes or None
    return _regular(folder, top), None


def _one_folder_per_class(folder: Path, subs: list[Path]) -> None:
    """Refuse two class folders that are one folder, or one inside the other (a symlink), naming both."""
    real = {sub: Path(os.path.realpath(sub)) for sub in subs}
    owner = {}
    for sub in sorted(subs, key=Path.is_symlink):                   # a real folder owns its path
        owner.setdefault(real[sub], sub)
    for sub in sorted(subs, key=lambda s: not s.is_symlink()):     # links first: each named as one
        for place in (real[sub], *real[sub].parents):
            other = owner.get(place)
            if other is not None and other != sub:
                how = "is" if place == real[sub] else "is inside"
                raise InputError(f"--images {folder}: the class folders {sub.name!r} and {other.name!r} hold the "
                                 f"same images ({sub.name!r} {how} {place}{', a link' if sub.is_symlink() else ''}): "
                                 f"they would be cached twice, as two classes; remove the link (or copy the "
                                 f"images, if both classes are meant) and rerun")


def image_keys(folder: Path, files: list[Path]) -> list[str]:
    """The key of each file: its path under `folder` (`a.png`, or `cat/a.png` in a class subfolder)."""
    return [p.relative_to(folder).as_posix() for p in files]


def _wanted(path: Path) -> bool:
    return not path.name.startswith((".", "__"))


def _tree_files(sub: Path) -> list[Path]:
    found = (p for p in sub.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES)
    return sorted((p for p in found if all(_wanted(Path(part)) for part in p.relative_to(sub).parts)),
                  key=lambda p: p.relative_to(sub).as_posix())


def _regular(folder: Path, files: list[Path]) -> list[Path]:
    """`files` when every one is a regular file named in UTF-8; else InputError naming those that are not."""
    for path in files:
        try:
            path.relative_to(folder).as_posix().encode("utf-8")
        except UnicodeEncodeError:
            raise InputError(f"--images {folder}: the file name {os.fsencode(path.relative_to(folder))!r} is "
                             f"not UTF-8 (no export could write it as a key); rename it to UTF-8 (e.g. convmv "
                             f"-f latin1 -t utf-8 --notest), then rerun") from None
    odd = [(p, not_regular(p)) for p in files]
    odd = [(p, kind) for p, kind in odd if kind]
    if odd:
        named = ", ".join(f"{p.relative_to(folder)} ({kind})" for p, kind in odd[:5]) + (" ..." if len(odd) > 5 else "")
        raise InputError(f"--images {folder}: {len(odd)} of its {len(files)} image names are not regular "
                         f"files: {named}; a FIFO or device would block the read. Move them out of the "
                         f"folder (nothing was written) and rerun")
    if not files:
        raise InputError(f"--images {folder} holds no image files ({', '.join(IMAGE_SUFFIXES)})")
    return files


def read_deadline() -> float:
    """Seconds one image file may take to read: NBLIB_READ_DEADLINE_S (default 60; a frozen mount)."""
    from nblib.store.retry import seconds_from_env

    return seconds_from_env(READ_DEADLINE_ENV, DEFAULT_READ_DEADLINE_S, example=120, finite=True)


def dataset_column(dataset, column: str):
    if column not in dataset.column_names:
        raise InputError(f"the dataset has no column {column!r}; its columns are {dataset.column_names}: "
                         f"pass column=... (--column)")
    return _dataset_rows(dataset, column)


def _dataset_rows(dataset, column: str) -> Iterator:
    """The column's cells. A `datasets.Image` column is read undecoded ({bytes, path}) and decoded by
    the one pixel policy: `datasets` would apply EXIF orientation itself, and draft no JPEG.
    """
    import datasets

    dataset = dataset.select_columns([column])      # no other column decoded, nor read
    feature = (dataset.features or {}).get(column)
    mode = feature.mode if isinstance(feature, datasets.Image) else None
    if isinstance(feature, datasets.Image) and feature.decode:
        dataset = dataset.cast_column(column, datasets.Image(decode=False))
    for k, row in enumerate(dataset):
        where = f"row {k:,} of the dataset (column {column!r})"
        if row[column] is None:
            raise InputError(f"{where} has no image (None): a missing image; fill it or drop the row")
        yield image_cell(row[column], where, mode)


def arrow_reader(path: Path):
    """An Arrow file (IPC file format) or stream (the format datasets writes) as a batch reader."""
    import pyarrow as pa

    try:
        return pa.ipc.open_stream(pa.memory_map(str(path)))
    except pa.ArrowInvalid:
        file = pa.ipc.open_file(pa.memory_map(str(path)))
        batches = (file.get_batch(k) for k in range(file.num_record_batches))
        return pa.RecordBatchReader.from_batches(file.schema, batches)


def column_batches(path: Path, column: str):
    """One column of a Parquet or Arrow file, batch by batch."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        yield from pq.ParquetFile(path).iter_batches(batch_size=256, columns=[column])
    else:
        for batch in arrow_reader(path):
            yield batch.select([column])


def table_images(files: list[Path], column: str) -> Iterator:
    for path in files:
        row = 0
        for batch in column_batches(path, column):
            for value in batch.column(0).to_pylist():
                yield image_cell(value, f"{path} row {row:,} (column {column!r})")
                row += 1


def image_cell(value, where: str = "a Parquet cell", mode: str | None = None):
    """A table cell as `as_image` takes it: an HF Image struct {bytes, path} (a local path read within the
    read deadline) or encoded bytes as an `EncodedImage`; nested lists (Array3D) or arrays as an array.
    """
    if isinstance(value, dict):
        data, path = value.get("bytes"), value.get("path")
        value = data if data is not None or not path else read_file_within(Path(path), read_deadline())
    if value is None:
        raise InputError(f"{where} has no image (null): a missing image; fill it or drop the row")
    if isinstance(value, (bytes, bytearray)):
        return EncodedImage(bytes(value), where, mode)
    if hasattr(value, "convert") and hasattr(value, "mode"):    # a PIL image, as a decoded column gives
        return value
    return np.asarray(value, dtype=np.uint8)


def read_file_within(path: Path, deadline_s: float) -> bytes:
    """A regular file's bytes, read on a daemon thread within `deadline_s` (a frozen mount cannot
    hang the build); opened non-blocking and checked with fstat, so a FIFO is refused, not waited on.
    """
    from nblib.store.deadline import call_within

    def read() -> bytes:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        try:
            if not stat_mode.S_ISREG(os.fstat(fd).st_mode):
                raise InputError(f"{path} is not a regular file ({not_regular(path)}); move it out of "
                                 f"the folder and rerun")
            with os.fdopen(os.dup(fd), "rb") as f:
                return f.read()
        finally:
            os.close(fd)

    try:
        return call_within(read, deadline_s, what=str(path), thread_name="nblib-image-read")
    except TimeoutError:
        raise InputError(f"{path} could not be read within {deadline_s:g} s (a frozen mount, or a "
                         f"special file?); fix the mount or move the file away and rerun (the cache "
                         f"resumes), or raise {READ_DEADLINE_ENV}") from None


def not_regular(path: Path) -> str | None:
    """What a path is when it is not a regular file ("a FIFO", "a folder", ...), else None."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "a broken link"
    if stat_mode.S_ISREG(mode):
        return None
    kinds = ((stat_mode.S_ISFIFO, "a named pipe (FIFO)"), (stat_mode.S_ISDIR, "a folder"),
             (stat_mode.S_ISSOCK, "a socket"), (stat_mode.S_ISCHR, "a character device"),
             (stat_mode.S_ISBLK, "a block device"))
    return next((name for test, name in kinds if test(mode)), "not a regular file")
