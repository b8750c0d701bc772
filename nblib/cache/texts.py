"""The texts a cache renders: read a text file or JSONL, fingerprint them, and the repo's sample texts.

A text file holds one text per line (an empty line is an empty text, a blank image, so line k is
sample k - 1); a `.jsonl` file holds one record per line and the text is its `field` ("text" by
default; blank lines are skipped). A file is re-read on each pass instead of held in memory, so
1.9M texts cost no RAM; the fingerprint (a sha256 over the length-prefixed texts) is what a
cache records to refuse resuming with other texts. A UTF-8 byte order mark at the start of a file
is stripped.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from nblib.errors import ConfigError, InputError

TEXT_SUFFIXES = (".jsonl", ".ndjson", ".txt")
BOM = b"\xef\xbb\xbf"  # UTF-8 byte order mark: stripped from the start of a file


def read_texts(path: str | Path, field: str | None = None, errors: str = "strict") -> Iterator[str]:
    """Texts of a file: one per line, or the `field` of each JSONL record (blank lines skipped).

    `.jsonl` files default to field "text". Invalid UTF-8 raises InputError naming the line,
    unless errors="replace" (U+FFFD replaces the bad bytes).
    """
    path, field = _check_text_file(path, field, errors)
    return _read_lines(path, field, errors)


@dataclass(frozen=True)
class TextSource:
    """Where the texts come from: a file (re-read on each pass) or an in-memory sequence."""

    path: Path | None = None
    field: str | None = None
    errors: str = "strict"
    texts: Sequence[str] | None = None

    def __iter__(self) -> Iterator[str]:
        if self.path is not None:
            return read_texts(self.path, self.field, self.errors)
        return iter(self.texts)

    def where(self, index: int) -> str:
        """Where text `index` is: "PATH: line N" for a file (JSONL blank lines counted), else "text N"."""
        if self.path is None:
            return f"text {index} of the list"
        if self.field is None:
            return f"{self.path}: line {index + 1}"
        seen = -1
        for number, line in _lines(self.path, "replace"):        # as read_texts counts them
            seen += bool(line.strip())
            if seen == index:
                return f"{self.path}: line {number}"
        return f"{self.path}: text {index}"

    def describe(self) -> dict:
        """What the manifest records to find the texts again for a repair."""
        path = self.path is not None
        return {"path": str(self.path) if path else None, "field": self.field if path else None, "errors": self.errors}


def text_source(texts, field: str | None = None, errors: str = "strict") -> TextSource:
    """A TextSource from a path (str or Path) or a sequence/iterable of str (materialized)."""
    if isinstance(texts, TextSource):
        return texts
    if isinstance(texts, (str, os.PathLike)):
        path, field = _check_text_file(Path(texts).expanduser().resolve(), field, errors)
        return TextSource(path=path, field=field, errors=errors)
    if not isinstance(texts, Sequence):
        texts = list(texts)
    return TextSource(texts=texts, errors=errors)


def source_fingerprint(texts: Iterable[str]) -> str:
    """sha256 over the texts, each length-prefixed (so ["ab"] and ["a", "b"] differ)."""
    return scan_texts(texts, sample_size=0).sha256


@dataclass(frozen=True)
class TextScan:
    """One pass over the texts: their fingerprint, their count and a seeded sample."""

    sha256: str
    n_texts: int
    sample: list[str] = field(default_factory=list)


def scan_texts(texts: Iterable[str], sample_size: int, seed: int = 0) -> TextScan:
    """One pass: fingerprint, count, and a seeded reservoir sample of the texts."""
    h = hashlib.sha256()
    rng = random.Random(seed)
    sample: list[str] = []
    n = 0
    for n, text in enumerate(texts, start=1):
        if not isinstance(text, str):
            raise InputError(f"text {n - 1} is a {type(text).__name__}, not a str: {text!r:.80}")
        data = text.encode("utf-8", "surrogatepass")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
        if len(sample) < sample_size:
            sample.append(text)
        elif sample_size and (j := rng.randrange(n)) < sample_size:
            sample[j] = text
    return TextScan(sha256=h.hexdigest(), n_texts=n, sample=sample)


def require_texts(scan: TextScan, source: TextSource) -> None:
    """Refuse a source without a single text: a cache of 0 images is always a mistake."""
    if scan.n_texts:
        return
    if source.path is None:
        raise InputError("the list of texts is empty; pass at least one text (a cache of 0 images "
                         "is refused)")
    size = source.path.stat().st_size
    what = "is empty" if size == 0 else f"holds only blank lines ({size:,} bytes)"
    raise InputError(f"text file {source.path} {what}: there is no text to render; pass a file "
                     f"with one text per line, or JSONL records with a {source.field or 'text'!r} field")


def sample_texts_path() -> Path:
    """Where the repo's data/sample_texts.jsonl is (2,000 varied texts)."""
    from nblib.env import repo_root

    return (repo_root() or Path.cwd()) / "data" / "sample_texts.jsonl"


def sample_texts(n: int | None = None) -> list[str]:
    """The texts of data/sample_texts.jsonl, cycled to `n` (all 2,000 when n is None)."""
    texts = list(read_texts(sample_texts_path()))
    if n is None or not texts:
        return texts
    return [texts[i % len(texts)] for i in range(n)]


# ====================================================================================== helpers


def read_records(path: str | Path, field: str | None = None, errors: str = "strict") -> Iterator[tuple[int, dict]]:
    """(line number, record) of each non-blank line of a JSONL file whose text is record[field] ("text" by
    default), read and checked as `read_texts` reads it.
    """
    path, field = _check_text_file(path, field or "text", errors)
    for number, line in _lines(path, errors):
        if line.strip():
            yield number, _json_record(line, field, path, number)


def _lines(path: Path, errors: str) -> Iterator[tuple[int, str]]:
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if number == 1 and raw.startswith(BOM):
                raw = raw[len(BOM):]  # a byte order mark (Windows editors write one) is not text
            raw = raw.removesuffix(b"\n").removesuffix(b"\r")
            try:
                line = raw.decode("utf-8", errors=errors)
            except UnicodeDecodeError as exc:
                raise InputError(
                    f"{path}: line {number} is not valid UTF-8 (byte {exc.start}: "
                    f"{raw[exc.start:exc.start + 4]!r}); fix the file or pass errors='replace' "
                    f"(--errors replace) to substitute U+FFFD") from None
            yield number, line


def _read_lines(path: Path, field: str | None, errors: str) -> Iterator[str]:
    for number, line in _lines(path, errors):
        if field is None:
            yield line
        elif line.strip():
            yield _json_record(line, field, path, number)[field]


def _check_text_file(path, field: str | None, errors: str) -> tuple[Path, str | None]:
    """The path and the JSONL field to read (.jsonl defaults to 'text'), or a clear error."""
    path = Path(path)
    if errors not in ("strict", "replace"):
        raise ConfigError(f"errors={errors!r}: choose 'strict' (refuse invalid UTF-8) or 'replace'")
    if path.is_dir():
        inside = sorted(p.name for p in path.iterdir() if p.suffix in TEXT_SUFFIXES)
        hint = f" such as {path / inside[0]}" if inside else ""
        raise InputError(f"text file {path} is a folder, not a file; pass --texts with one file{hint} "
                         f"(one text per line, or JSONL with --field)")
    if not path.is_file():
        raise InputError(f"text file {path} does not exist; pass --texts with a file of one text "
                         f"per line, or JSONL with --field")
    if field is None and path.suffix in (".jsonl", ".ndjson"):
        field = "text"
    return path, field


def _json_record(line: str, field_name: str, path: Path, number: int) -> dict:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise InputError(f"{path}: line {number} is not JSON ({exc.msg} at column {exc.colno}); "
                         f"for a plain text file drop --field") from None
    except RecursionError:
        raise InputError(f"{path}: line {number} nests JSON arrays or objects too deeply for Python's "
                         f"parser ({len(line):,} characters); flatten that record or drop it") from None
    except ValueError as exc:  # an integer of more digits than Python converts (sys.int_info)
        reason = str(exc).split(";")[0]
        raise InputError(f"{path}: line {number} cannot be read as JSON ({reason}); store that value as a "
                         f"string, or drop it from the record") from None
    if not isinstance(record, dict) or field_name not in record:
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise InputError(f"{path}: line {number} has no field {field_name!r} (has: {keys}); "
                         f"pick the field with --field")
    if not isinstance(record[field_name], str):
        raise InputError(f"{path}: line {number}: field {field_name!r} is a "
                         f"{type(record[field_name]).__name__}, not a string")
    return record
