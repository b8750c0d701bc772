"""A labelled image cache of the sample texts: the train tests' data, and benchmarks/train_loop_overhead.py's."""
from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def labelled_cache(folder: Path, n: int) -> Path:
    """A real 64 px cache of the first `n` sample texts, built from a .jsonl so labels come with it."""
    from nblib.cache import populate

    folder.mkdir(parents=True, exist_ok=True)
    texts = folder / "texts.jsonl"
    lines = (REPO / "data" / "sample_texts.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)[:n]
    texts.write_text("".join(lines), encoding="utf-8")
    populate(texts, folder / "cache", image_size=64, shard_mb=0.5, workers=0, progress=False)
    return folder / "cache"
