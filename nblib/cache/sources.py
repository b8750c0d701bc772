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

import json
import re
import tarfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from nblib.cache.images import (
    _dataset_rows,
    _is_hf_folder,
    arrow_reader,
    column_batches,
    encoded_files,
    folder_images,
    image_items,
    image_keys,
    recorded_json,
    table_images,
)
from nblib.cache.labels import label_index, labels_and_classes, labels_from_file
from nblib.cache.pixels import EncodedImage
from nblib.errors import InputError, one_line

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
    if not folder.is_dir() or _is_hf_folder(folder):
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
        source.labels = _indices(classes, source.classes)
        source.origin = "subfolders"
    return source


def _indices(values: list[str], classes: list[str]) -> list[int]:
    lookup = {c: k for k, c in enumerate(classes)}
    return [lookup[v] for v in values]


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
    files = _table_files(local)
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
    source.images = _wds_images(paths, source)
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


def _table_files(path: Path) -> list[Path]:
    if path.is_file():
        if path.suffix not in (".parquet", ".arrow"):
            raise InputError(f"--hf {path} is a {path.suffix or 'suffix-less'} file; pass a .parquet or "
                             f".arrow file, a folder of them, or a save_to_disk folder")
        return [path]
    files = sorted(path.glob("*.parquet")) or sorted(path.glob("*.arrow"))
    if not files:
        raise InputError(f"--hf {path} holds no .parquet or .arrow files and is no save_to_disk folder")
    return files


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


def _wds_images(paths: list[Path], source: ImageSource) -> Iterator:
    for path in paths:
        for key, members in _wds_samples(path):
            yield _wds_sample(path, key, members, source)


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
