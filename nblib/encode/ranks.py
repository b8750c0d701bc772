"""The shared run folder's bookkeeping for several processes: who was given which parts, and what is missing.

Each process that encodes parts records what it was given and what it wrote in its own file under
`<run>/ranks/` (`RankRecord`), so a consolidation that finds parts missing can say which shard
(or launch) owes them (`require_all_parts`). Parts are split in contiguous blocks (`split`),
which keeps each process's reads sequential in the cache. `DurableProgress` is one bar over the
whole run's durable parts, re-counted from the folder. Nothing here imports torch.
"""
from __future__ import annotations

import collections
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from nblib.encode.layout import part_name
from nblib.encode.protocols import PartStore
from nblib.errors import ManifestDamaged, StateError
from nblib.manifest import read_manifest, write_manifest
from nblib.store.parts import PartInfo, VerifyLevel

__all__ = [
    "PROGRESS_POLL_S", "RANKS_FOLDER", "RECORD_KIND", "RECORD_VERSION", "DurableProgress", "RankRecord",
    "durable_parts_shared", "part_writes", "read_records", "require_all_parts", "split",
]

log = logging.getLogger(__name__)

RANKS_FOLDER = "ranks"             # under the run folder: one record per process that encoded parts
RECORD_KIND = "nblib.encode.rank"
RECORD_VERSION = 1
PROGRESS_POLL_S = 2.0              # rank 0's bar re-counts the durable parts this often
_PART_FILE = "part.json"


def split(items: Sequence, index: int, count: int) -> list:
    """Block `index` of `count` near-equal contiguous blocks of `items` (the first ones one longer)."""
    items = list(items)
    size, extra = divmod(len(items), count)
    start = index * size + min(index, extra)
    return items[start:start + size + (index < extra)]


def part_writes(run_dir: str | Path) -> dict[str, int]:
    """How many times each part was written, over every process's record (a count of 2: done twice)."""
    counts = collections.Counter(name for record in read_records(run_dir) for name in record["written"])
    return dict(sorted(counts.items()))


def read_records(run_dir: str | Path) -> list[dict]:
    """Every process's record under run_dir/ranks (what it was given, wrote, when), oldest first."""
    records = []
    for path in sorted((Path(run_dir) / RANKS_FOLDER).glob("*.json")):
        try:
            record = read_manifest(path, RECORD_KIND, versions=(RECORD_VERSION,))
        except ManifestDamaged as exc:
            log.warning("%s; that record is skipped", exc)
            continue
        if record is not None:
            records.append(record.body)
    return sorted(records, key=lambda r: r["started"])


def require_all_parts(run_dir: str | Path, durable: Sequence[str], n_parts: int) -> None:
    """StateError naming the parts not yet durable and the shards (or ranks) that were to write them."""
    durable = set(durable)
    missing = [k for k in range(n_parts) if part_name(k) not in durable]
    if not missing:
        return
    lines = [f"run {run_dir} is not complete: {len(missing)} of {n_parts} parts are not durable yet "
             f"({_name_ranges(missing)})"]
    lines += _who_owes(read_records(run_dir), missing, n_parts)
    lines.append("run the missing shards with the same arguments (python -m nblib encode ... --shard I/N) "
                 "or rerun the launch, then --consolidate again; the durable parts are kept")
    raise StateError("; ".join(lines))


def durable_parts_shared(store: PartStore, verify: VerifyLevel, watched: set[str]) -> list[PartInfo]:
    """The verified parts of a folder several processes write; damaged ones are logged only when `watched`.

    A part another process is writing right now looks torn (its .npy files without part.json), so
    only the damaged parts this process answers for are reported (they are encoded again by the
    process given them either way).
    """
    parts, damaged = store.local.list(verify)
    mine = [d for d in damaged if d.name in watched]
    if mine:
        listed = "; ".join(f"{d.name} ({d.reason})" for d in mine[:5])
        log.warning("%d damaged parts are ignored (encoded again by the process given them): %s", len(mine), listed)
    return parts


class RankRecord:
    """One process's record under run_dir/ranks: its role, rank, host, pid, the parts given and written."""

    def __init__(self, run_dir: Path, role: str, rank: int, size: int, launch: str | None, assigned: list[int]):
        host = re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname())[:64]
        self.path = Path(run_dir) / RANKS_FOLDER / f"{role}-{rank}-of-{size}.{host}.{os.getpid()}.json"
        self.body = {"role": role, "rank": rank, "size": size, "launch": launch,
                     "host": socket.gethostname(), "pid": os.getpid(),
                     "assigned": [part_name(k) for k in assigned], "written": [],
                     "started": time.time(), "updated": time.time()}
        self._seq = 0
        self._save()

    def wrote(self, name: str) -> None:
        """Add part `name` to the parts this process wrote (the record is rewritten atomically)."""
        self.body["written"].append(name)
        self.body["updated"] = time.time()
        self._save()

    def _save(self) -> None:
        write_manifest(self.path, RECORD_KIND, self.body, version=RECORD_VERSION, seq=self._seq)
        self._seq += 1


# ------------------------------------------------------------------------------ progress


class DurableProgress:
    """One bar for the whole run: parts whose part.json is there, re-counted every few seconds."""

    def __init__(self, parts_dir: Path, names: list[str], desc: str = "encode", poll_s: float = PROGRESS_POLL_S):
        self.parts_dir, self.names, self.desc, self.poll_s = parts_dir, names, desc, poll_s
        self.done: set[str] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.bar = None

    def count(self) -> int:
        """Parts durable now (those seen once stay counted: only the others are looked at)."""
        for name in self.names:
            if name not in self.done and (self.parts_dir / name / _PART_FILE).is_file():
                self.done.add(name)
        return len(self.done)

    def __enter__(self) -> DurableProgress:
        from nblib.compare import progress_bar

        self.bar = progress_bar(len(self.names), self.desc, "part", initial=self.count())
        self._thread = threading.Thread(target=self._poll, name="nblib-durable-progress", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._update()
        self.bar.close()

    def _poll(self) -> None:
        while not self._stop.wait(self.poll_s):
            self._update()

    def _update(self) -> None:
        self.bar.update(self.count() - self.bar.n)


def _name_ranges(indices: list[int]) -> str:
    """part-000002..part-000005, part-000009: runs of consecutive parts, the first 8 runs."""
    runs: list[list[int]] = []
    for k in indices:
        if runs and k == runs[-1][1] + 1:
            runs[-1][1] = k
        else:
            runs.append([k, k])
    text = [part_name(a) if a == b else f"{part_name(a)}..{part_name(b)}" for a, b in runs[:8]]
    return ", ".join(text) + (f" and {len(runs) - 8} more runs" if len(runs) > 8 else "")


def _who_owes(records: list[dict], missing: list[int], n_parts: int) -> list[str]:
    """One line per shard (or launch) whose parts are missing: never ran, or ran and stopped."""
    shard_counts = sorted({r["size"] for r in records if r["role"] == "shard"})
    if not shard_counts and not records:
        return ["no shard or rank has recorded work in this folder yet"]
    lines = []
    for count in shard_counts or []:
        for index in range(count):
            owed = [k for k in split(range(n_parts), index, count) if k in set(missing)]
            if not owed:
                continue
            ran = [r for r in records if (r["role"], r["rank"], r["size"]) == ("shard", index, count)]
            if not ran:
                status = "never ran here"
            else:
                last = ran[-1]
                where = f"ran on {last['host']} (pid {last['pid']}) and wrote"
                status = (f"{where} all {len(last['assigned'])} of its parts, but these are missing or damaged now"
                          if set(last["written"]) >= set(last["assigned"]) else
                          f"{where} {len(last['written'])} of its {len(last['assigned'])} parts, then stopped "
                          f"or is still running")
            lines.append(f"shard {index}/{count} owes {_name_ranges(owed)}: {status}")
    if not shard_counts:
        launches = sorted({(r["size"], r["launch"]) for r in records}, key=str)
        lines.append(f"they were left by {len(launches)} torchrun launch(es) of "
                     f"{', '.join(str(s) for s, _ in launches)} ranks")
    return lines

