"""Run events (damaged parts skipped, resumes) go through `logging`, one record per event.

`warnings.warn` shows a call site's warning once under the default filter, so a second damaged part
of the same run could be swallowed; a log record is never folded into another.
"""
from __future__ import annotations

import logging
import warnings
from pathlib import Path

import numpy as np
import pytest

from conftest import small_cache
from nblib import encode as enc
from nblib.cache import ShardedImageCache
from nblib.config import preset
from nblib.store import DurableStore

CONFIG = preset("smoke").replace(batch_size=16, checkpoint_every=1, consolidate_every=1)


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread(one_torch_thread):
    """Every test of this module encodes with one torch thread."""


def _truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


def _damaged_records(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno >= logging.WARNING and r.name.startswith("nblib") and "damaged copy" in r.getMessage()]


def test_two_damaged_parts_in_one_store_listing_give_two_log_records(tmp_path, caplog):
    store = DurableStore(tmp_path)
    for k in range(3):
        store.write_part(f"part-{k:06d}", {"ids": np.arange(10 * k, 10 * k + 10)})
    _truncate(tmp_path / "part-000000" / "ids.npy")
    _truncate(tmp_path / "part-000002" / "ids.npy")
    with warnings.catch_warnings(), caplog.at_level(logging.WARNING, logger="nblib"):
        warnings.simplefilter("error")          # nothing goes through warnings any more
        assert [p.name for p in store.list_parts()] == ["part-000001"]
    records = _damaged_records(caplog)
    assert len(records) == 2, records
    assert "part-000000" in records[0] and "part-000002" in records[1]


def test_two_damaged_parts_in_one_resumed_run_give_two_log_records_and_are_recomputed(tmp_path, caplog):
    cache = ShardedImageCache(small_cache(tmp_path / "c", [f"text {i}" for i in range(64)]))
    first = enc.encode(cache, tmp_path / "r", CONFIG, device="cpu", progress=False, preflight=False)
    for name in ("part-000001", "part-000003"):
        _truncate(tmp_path / "r" / enc.PARTS_FOLDER / name / "sketches.npy")
    with caplog.at_level(logging.WARNING, logger="nblib"):
        again = enc.encode(cache, tmp_path / "r", CONFIG, device="cpu", progress=False, preflight=False)
    records = _damaged_records(caplog)
    assert len(records) == 2 and "part-000001" in records[0] and "part-000003" in records[1], records
    assert again.parts_encoded == 2
    resumed = [r.getMessage() for r in caplog.records if "will be recomputed" in r.getMessage()]
    assert resumed and "part-000001" in resumed[0] and "part-000003" in resumed[0]
    assert {o: np.load(p).tobytes() for o, p in again.outputs.items()} == \
        {o: np.load(p).tobytes() for o, p in first.outputs.items()}
