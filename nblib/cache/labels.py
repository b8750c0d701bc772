"""Class labels for a cache of images, checked once, when the cache is built.

Labels come from class subfolders (`root/cat/*.jpg`: the ImageFolder convention), from a labels file
(`--labels FILE`: a CSV or JSON of (file, label)), from an HF label column or from webdataset `cls`
members. Whatever their origin they go through `labels_and_classes`: integers are class indices
(0..n-1), anything else a class name (classes sorted, as ImageFolder sorts its folders). A label that
is missing, negative, not below MAX_CLASSES, or a column that gives more than MAX_CLASSES classes (or
a class per row: ids or captions, not classes) is refused in one line naming the row and the fix, before
training ever sees it. `train` then reads the labels as they were recorded, unchecked.

A label is one scalar: a list, tuple or dict (`[0]`, a one-hot row) is refused. A float that is a whole
number (`1.0`, as pandas writes an int column holding a NaN) is the class index it names, in JSON, in an
HF column and in a CSV cell ("1.0") alike; any other float (0.5, NaN) is refused. A labels file is read
as UTF-8, its byte-order mark (Excel's "CSV UTF-8") dropped; other bytes are refused naming the line.
"""
from __future__ import annotations

import csv
import io
import json
import unicodedata
from pathlib import Path

from nblib.errors import InputError

MAX_CLASSES = 1_000_000       # ImageNet-21k has 21,841 classes; a label past this is an id, a hash or a typo
DISTINCT_ROWS = 100           # at least this many rows, each with a label of its own: not a class column


def class_name(folder_name: str) -> str:
    """The class a subfolder names: its name in Unicode NFC (macOS writes NFD, Linux keeps either)."""
    return unicodedata.normalize("NFC", folder_name)


def label_index(value, where: str) -> int:
    """One integer label, checked: a class index in 0..MAX_CLASSES-1, else InputError naming `where`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(f"{where}: label {value!r} is not an integer class index")
    if value < 0:
        hint = " (datasets marks a missing ClassLabel with -1, as in a test split)" if value == -1 else ""
        raise InputError(f"{where}: label {value} is negative{hint}; labels are class indices 0..n-1: "
                         f"drop the unlabelled rows or fix the label")
    if value >= MAX_CLASSES:
        raise InputError(f"{where}: label {value:,} would make {value + 1:,} classes, over the "
                         f"{MAX_CLASSES:,} nblib takes; labels are class indices 0..n-1: pass the class "
                         f"column, not an id")
    return value


def labels_and_classes(values: list, names: list[str] | None, where: str) -> tuple[list[int], list[str]]:
    """(class index per row, class names): `names` (a ClassLabel's) when known, else 0..max for integer
    labels (whole floats count as integers), else the sorted distinct values. Every refusal is one
    InputError line naming the row.
    """
    if any(v is None for v in values):
        raise InputError(f"{where}: row {values.index(None):,} has no label; fill it or drop the row")
    values = [scalar_label(v, f"{where} row {k:,}") for k, v in enumerate(values)]
    if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        checked = [label_index(v, f"{where} row {k:,}") for k, v in enumerate(values)]
        top = max(checked, default=-1)
        if names is not None and top >= len(names):
            raise InputError(f"{where} row {checked.index(top):,}: label {top} is past the {len(names)} class "
                             f"names ({names[0]!r}..{names[-1]!r}); fix the label or the names")
        return checked, list(names) if names is not None else [str(k) for k in range(top + 1)]
    classes = sorted({str(v) for v in values})
    if len(classes) > MAX_CLASSES or (len(values) >= DISTINCT_ROWS and len(classes) == len(values)):
        raise InputError(f"{where}: {len(classes):,} distinct labels in {len(values):,} rows (e.g. "
                         f"{classes[0]!r}): that is a column of ids or captions, not of classes (at most "
                         f"{MAX_CLASSES:,}, and rows share them); pass the class column")
    lookup = {c: k for k, c in enumerate(classes)}
    return [lookup[str(v)] for v in values], classes


def scalar_label(value, where: str):
    """One label as a class index or name: a whole float is its int; a list, dict, tuple, or another
    float (0.5, NaN, inf) is refused in one line naming `where`.
    """
    if isinstance(value, (list, tuple, dict, set)):
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        raise InputError(f"{where}: label {shown} is a {type(value).__name__}, not one class; write each label "
                         f"as one class index (0) or name (\"cat\"), not a list or a one-hot row")
    if isinstance(value, float):
        if not value.is_integer():
            raise InputError(f"{where}: label {value!r} is not a whole number, so no class index; write class "
                             f"indices as integers (0, 1, ...) or classes as names (\"cat\")")
        return int(value)
    return value


def labels_from_file(path: str | Path, keys: list[str], folder: str) -> tuple[list[int], list[str]]:
    """(label per key, class names) from a CSV (rows `file,label`; a first row naming no image is its
    header) or a JSON file ({file: label}, or a list of [file, label] or {"file", "label"}).

    A file is named by its path under the images folder (`cat/a.jpg`, or `a.jpg` for a flat folder), or
    without its suffix (`a`) where that is unambiguous. Every image needs one label, and every row must
    name an image: anything else is refused, naming the first offender.
    """
    path = Path(path)
    if not path.is_file():
        raise InputError(f"--labels {path} is not a file; pass a CSV or JSON file of (file, label)")
    lookup = _names(keys)
    rows = _rows(path)
    if path.suffix.lower() == ".csv" and rows and _key(lookup, rows[0][0]) is None:
        rows = rows[1:]                             # a header ("file,label", "id,class", ...)
    found: dict[str, object] = {}
    strays = []
    for name, label in rows:
        key = _key(lookup, name)
        if key is None:
            strays.append(name)
        elif found.setdefault(key, label) != label:
            raise InputError(f"--labels {path}: {key} has two labels, {found[key]!r} and {label!r}; keep one")
    if strays:
        raise InputError(f"--labels {path}: {len(strays):,} rows name no image of {folder} (first: {strays[0]!r}); "
                         f"name files by their path under {folder} (e.g. {keys[0]!r}), or drop those rows")
    missing = [k for k in keys if k not in found]
    if missing:
        raise InputError(f"--labels {path}: {len(missing):,} of the {len(keys):,} images have no label (first: "
                         f"{missing[0]!r}); add a row for each, or move those images out")
    values = [scalar_label(found[k], f"--labels {path}: {k!r}") for k in keys]
    numbers = [_whole_number(v) for v in values]
    if all(n is not None for n in numbers):
        values = numbers                            # "0", "1", "1.0": class indices, as in a CSV
    return labels_and_classes(values, None, f"--labels {path}")


def _whole_number(value) -> int | None:
    """A CSV cell or JSON value that is a whole number ("3", "3.0", 3) as an int, else None."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    text = value.strip() if isinstance(value, str) else ""
    if text.isdigit():
        return int(text)
    try:
        number = float(text)
    except ValueError:
        return None
    return int(number) if number.is_integer() and number >= 0 and "." in text else None


def _rows(path: Path) -> list[tuple[str, object]]:
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(_utf8_text(path))
        except ValueError as exc:
            raise InputError(f"--labels {path} is not JSON ({exc})") from None
        if isinstance(data, dict):
            return [(str(k), v) for k, v in data.items()]
        if isinstance(data, list) and all(isinstance(r, dict) and {"file", "label"} <= set(r) for r in data):
            return [(str(r["file"]), r["label"]) for r in data]
        if isinstance(data, list) and all(isinstance(r, list) and len(r) == 2 for r in data):
            return [(str(r[0]), r[1]) for r in data]
        raise InputError(f"--labels {path}: JSON must be {{file: label}}, [[file, label], ...] or "
                         f"[{{\"file\": ..., \"label\": ...}}, ...]")
    if path.suffix.lower() != ".csv":
        raise InputError(f"--labels {path} is a {path.suffix or 'suffix-less'} file; pass a .csv (file,label "
                         f"rows) or a .json file")
    rows = [r for r in csv.reader(io.StringIO(_utf8_text(path), newline="")) if r]
    short = next((k for k, r in enumerate(rows) if len(r) < 2), None)
    if short is not None:
        raise InputError(f"--labels {path} line {short + 1} has {len(rows[short])} column; each row is file,label")
    return [(r[0].strip(), r[1].strip()) for r in rows]


def _utf8_text(path: Path) -> str:
    """A labels file's text: UTF-8, a leading byte-order mark dropped (Excel's "CSV UTF-8"); other
    bytes are refused in one line naming the line and its bytes.
    """
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        bad = data[exc.start:exc.start + 4]
        raise InputError(f"--labels {path} line {line:,} is not UTF-8 (bytes {bad!r} at byte {exc.start:,}); save "
                         f"the file as UTF-8 (Excel: \"CSV UTF-8\"; or iconv -f latin1 -t utf-8) and rerun") from None


def _names(keys: list[str]) -> dict[str, str]:
    """Every name a labels file may use for a key: the key, and the key without its suffix when unique,
    each also in Unicode NFC (a file written on a Mac spells "café" in NFD).
    """
    lookup = {k: k for k in keys}
    stems: dict[str, list[str]] = {}
    for k in keys:
        stems.setdefault(k.rsplit(".", 1)[0], []).append(k)
    lookup.update({stem: found[0] for stem, found in stems.items() if len(found) == 1 and stem not in lookup})
    return {**{class_name(name): key for name, key in lookup.items()}, **lookup}


def _key(lookup: dict[str, str], name: str) -> str | None:
    return lookup.get(name, lookup.get(class_name(name)))
