"""Consolidation: a complete run's parts merged in sample order into one `.npy` per output, plus an index.

Each output is streamed through `AtomicWriter` (its `np.save` header, then every part's rows in
sample order), so it is hashed while written, never held in RAM, never read back, and a full disk
raises OSError(ENOSPC) instead of killing the process as a memory-mapped write would. The free
space is checked first. The index (an `nblib.manifest` record written last) names each part's
range and the sha256 of the part files it came from, and per output file its bytes, sha256,
dtype and shape; each file's stat (size, mtime) is kept apart, in `index.stat.json`, so two identical
runs write byte-identical outputs and index. A rerun trusts a file whose size, header and recorded
mtime agree, hashes one that disagrees and rebuilds it if its bytes differ; `verify=True` hashes every
file. `load_outputs` refuses a file that disagrees with the index.
"""
from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np

from nblib.atomic import TMP_PREFIX, AtomicWriter, WrittenFile, npy_header, sha256_file
from nblib.budget.resources import fits, margin_words, shortfall_figure
from nblib.disk import disk_free
from nblib.encode.layout import RUN_KIND, RUN_VERSION, open_store, read_run_manifest, refuse_if_changed
from nblib.encode.protocols import PartStore, require_part_store
from nblib.errors import BudgetExceeded, DriveError, ManifestDamaged, StateError, os_errors_name
from nblib.lock import FolderLock, run_identity
from nblib.manifest import read_manifest, read_stat_cache, stat_record, stat_vouches, write_manifest, write_stat_cache
from nblib.store.parts import PartInfo, VerifyLevel
from nblib.units import fmt_bytes_pair

__all__ = [
    "INDEX_KIND", "INDEX_NAME", "INDEX_VERSION", "INDEX_VERSIONS", "consolidate", "hash_outputs",
    "load_outputs", "read_index", "recorded_hashes",
]

log = logging.getLogger(__name__)

INDEX_NAME = "index.json"
INDEX_KIND = "nblib.encode.index"
INDEX_VERSION = 3                 # 3: mtimes in index.stat.json; 2 (mtimes inside) is still read
INDEX_VERSIONS = (2, INDEX_VERSION)   # layout 1 (plain JSON) is read as damaged and rebuilt


def consolidate(run_dir: str | Path, out_dir: str | Path | None = None, *, store: PartStore | None = None,
                mirror_dir: str | Path | None = None, verify: bool = False,
                check_space: bool = True, lock: FolderLock | None = None) -> dict[str, Path]:
    """Write one `.npy` per output in sample order, plus an index; output name -> path.

    Args:
        run_dir: the run folder whose parts (run_dir/parts) are merged.
        out_dir: where the outputs and index go (default: run_dir).
        store: a `PartStore` to read the parts through (default: one opened on run_dir/parts).
        mirror_dir: the run's mirror, read for parts local staging lacks.
        verify: hash every existing output against the index instead of a stat check.
        check_space: refuse up front when the outputs do not fit the free space.
        lock: the lock the caller holds on out_dir (default: taken here).

    Returns:
        output name -> path of its consolidated `.npy`.

    A second call with nothing new checks the existing files against the index (the module docstring).
    """
    run_dir = Path(run_dir)
    out_dir = Path(out_dir) if out_dir is not None else run_dir
    held = contextlib.nullcontext(lock) if lock is not None else \
        FolderLock(out_dir, identity=run_identity("nblib.encode.consolidate"), what="run folder",
                   hint="consolidate into another out_dir", read_only_ok=True)
    own_store = store is None
    with held as out_lock:
        store = open_store(run_dir, mirror_dir) if own_store else require_part_store(store)
        try:
            manifest, read_part, parts = _readable_parts(store, run_dir)
            _require_parts_of_this_run(manifest, parts, store.local_dir)
            record = _index_record(out_dir)
            index = record.body if record is not None and _describes(record.body, manifest) else None
            stats = _recorded_stats(index, out_dir)
            stale, touched = _stale_outputs(index, manifest["outputs"], out_dir, verify, stats)
            if stale and index is not None:   # a WARNING when the caller asked to verify: it wants to know
                log.log(logging.WARNING if verify else logging.INFO, "rebuilt %s in %s: not the bytes the index "
                        "records (damaged, edited or cut); rebuilt from the parts",
                        ", ".join(f"{o}.npy" for o in stale), out_dir)
            if stale or index is None or record.version != INDEX_VERSION:
                out_lock.check()
                _write_outputs(read_part, manifest, parts, out_dir, stale, index, stats,
                               seq=record.seq + 1 if record is not None else 0, check_space=check_space)
            elif touched:                       # same bytes, new mtime: only the stat cache changes
                out_lock.check()
                write_stat_cache(out_dir / INDEX_NAME, {**stats, **{o: _stat(out_dir, index, o) for o in touched}})
        finally:
            if own_store:
                store.close()
    return {o: out_dir / f"{o}.npy" for o in manifest["outputs"]}


def read_index(out_dir: str | Path) -> dict | None:
    """The consolidated index of a run (its body), or None when there is none yet.

    ManifestDamaged when the index is torn, edited or of an older layout (consolidate rebuilds it).
    """
    record = read_manifest(Path(out_dir) / INDEX_NAME, INDEX_KIND, versions=INDEX_VERSIONS)
    return None if record is None else record.body


def load_outputs(out_dir: str | Path, mmap: bool = True, verify: bool = False) -> dict[str, np.ndarray]:
    """The consolidated arrays of a run, memory-mapped by default, each checked against the index.

    Args:
        out_dir: the folder `consolidate` wrote (the run folder by default).
        mmap: memory-map the files (False: read them into RAM).
        verify: hash each file instead of trusting its recorded mtime.

    Returns:
        output name -> array [n_samples, ...].

    Raises:
        StateError naming the file that is not the one consolidate wrote, and the fix; with `verify=True`
        a file whose sha256 matches is accepted even if it was touched or copied since.
    """
    out_dir = Path(out_dir)
    index = read_index(out_dir)
    if index is None:
        raise StateError(f"no consolidated outputs in {out_dir}; run encode (or consolidate) first")
    arrays, stats = {}, _recorded_stats(index, out_dir)
    for name in index["outputs"]:
        path, entry = out_dir / f"{name}.npy", index["files"][name]
        problem = _quick_problem(path, entry, stats.get(name))
        if verify and (problem is None or problem.startswith("was modified")):
            problem = _hash_problem(path, entry)
        if problem is not None:
            hint = ", or load with verify=True to accept it if its sha256 still matches" \
                if problem.startswith("was modified") else ""
            raise StateError(f"{path} {problem}: it is not the file consolidate wrote; rebuild it "
                             f"with nblib.encode.consolidate(<run folder>) or by rerunning encode "
                             f"with the same arguments{hint}")
        arrays[name] = np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
    return arrays


def recorded_hashes(out_dir: str | Path) -> dict[str, str]:
    """output name -> the sha256 the index records for its consolidated `.npy` (nothing is read but the index).

    StateError when there are no consolidated outputs yet. Two runs whose recorded hashes agree
    wrote the same bytes (the check a resumed == uninterrupted comparison makes).
    """
    index = read_index(out_dir)
    if index is None:
        raise StateError(f"no consolidated outputs in {out_dir}; run encode (or consolidate) first")
    return {name: index["files"][name]["sha256"] for name in index["outputs"]}


def hash_outputs(out_dir: str | Path) -> dict[str, str]:
    """output name -> the sha256 of its consolidated `.npy` as it is on disk now (reads every byte)."""
    return {name: sha256_file(Path(out_dir) / f"{name}.npy") for name in recorded_hashes(out_dir)}


# ------------------------------------------------------------------------------ helpers: the parts


def _readable_parts(store: PartStore, run_dir: Path) -> tuple[dict, Callable, dict[str, PartInfo]]:
    """(run manifest, how to read a part, the complete parts by name): local staging when it has them all.

    Reading local staging is faster than Drive and does not race the mirror thread's copies in
    flight; the mirror is read only for parts the local side lacks (retention, a new runtime).
    Parts are listed by size here; each is hashed when read.
    """
    manifest = read_run_manifest(store)
    local = {p.name: p for p in store.local.list(verify=VerifyLevel.SIZES)[0]}
    if manifest is not None and manifest.get("complete") and set(manifest["parts"]) <= set(local):
        return manifest, store.local.read, local
    try:
        parts = {p.name: p for p in store.list_parts(verify=VerifyLevel.SIZES)}
    except DriveError as exc:
        log.warning("%s; consolidating from the local copies instead", exc)
        parts = local
    _require_complete(manifest, parts, run_dir)
    return manifest, store.read_part, parts


def _require_complete(manifest: dict | None, parts: dict[str, PartInfo], run_dir: Path) -> None:
    """StateError unless the run manifest says the run is complete and every part it lists is there."""
    lost = sorted(set((manifest or {}).get("parts", {})) - set(parts))
    if manifest is None or not manifest.get("complete") or lost:
        done = 0 if manifest is None else manifest["samples_done"]
        total = "?" if manifest is None else f"{manifest['n_samples']:,}"
        gone = f"; parts {lost} are missing or damaged" if lost else ""
        raise StateError(f"run {run_dir} is not complete ({done:,} of {total} samples listed{gone}); "
                         f"rerun encode with the same arguments to finish it")


def _require_parts_of_this_run(manifest: dict, parts: dict[str, PartInfo], folder: Path) -> None:
    """Refuse a part whose meta names another run (fingerprints), another layout or other samples."""
    for name, rng in manifest["parts"].items():
        meta = dict(parts[name].meta or {})
        where = f"part {name} in {folder}"
        if (meta.get("kind"), meta.get("version"), meta.get("range")) != (RUN_KIND, RUN_VERSION, rng):
            raise StateError(f"{where} is not the part the run manifest lists (kind "
                             f"{meta.get('kind')!r}, layout {meta.get('version')!r}, samples "
                             f"{meta.get('range')} vs {rng}); delete its folder and rerun encode to "
                             f"recompute it")
        refuse_if_changed(meta.get("fingerprints", {}), manifest["fingerprints"], None, None, where)


# ------------------------------------------------------------------------------ helpers: the index


def _index_record(out_dir: Path):
    """The index record, or None when there is none or it cannot be trusted (with a warning)."""
    try:
        return read_manifest(out_dir / INDEX_NAME, INDEX_KIND, versions=INDEX_VERSIONS)
    except ManifestDamaged as exc:
        log.warning("%s; every output is rebuilt", exc)
        return None


def _describes(index: dict, manifest: dict) -> bool:
    """True when the index was built from this manifest's run: fingerprints, parts, outputs."""
    return (index.get("fingerprints") == manifest["fingerprints"]
            and index.get("n_samples") == manifest["n_samples"]
            and index.get("outputs") == manifest["outputs"]
            and {k: v["range"] for k, v in index.get("parts", {}).items()} == manifest["parts"]
            and set(index.get("files", {})) == set(manifest["outputs"]))


def _stale_outputs(index: dict | None, outputs: list[str], out_dir: Path, verify: bool,
                   stats: dict[str, dict]) -> tuple[list[str], list[str]]:
    """(outputs to rebuild, outputs only touched since: same bytes, their new stat is recorded)."""
    if index is None:
        return list(outputs), []
    stale, touched = [], []
    for name in outputs:
        path, entry = out_dir / f"{name}.npy", index["files"][name]
        problem = _quick_problem(path, entry, stats.get(name))
        if problem is None and not verify:
            continue
        size_or_header = problem is not None and not problem.startswith("was modified")
        if size_or_header or _hash_problem(path, entry) is not None:
            stale.append(name)
        elif problem is not None:               # touched, same bytes: trust its new stat from now on
            touched.append(name)
    return stale, touched


def _recorded_stats(index: dict | None, out_dir: Path) -> dict[str, dict]:
    """output -> the stat recorded at its last check: the stat cache, else (layout 2) the index's mtime."""
    if index is None:
        return {}
    inline = {o: {"mtime_ns": e["mtime_ns"]} for o, e in index.get("files", {}).items() if "mtime_ns" in e}
    return {**inline, **read_stat_cache(out_dir / INDEX_NAME)}


def _stat(out_dir: Path, index: dict, output: str) -> dict:
    """The stat record of a consolidated file as it is now, vouching for the sha256 the index records."""
    return stat_record(out_dir / f"{output}.npy", index["files"][output]["sha256"])


def _quick_problem(path: Path, entry: dict, recorded: dict | None) -> str | None:
    """Why a file disagrees with its index entry by size, `.npy` header or recorded mtime; None if it agrees."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return "is missing"
    if st.st_size != entry["bytes"]:
        return f"is {st.st_size:,} bytes, the index records {entry['bytes']:,}"
    header = npy_header(entry["dtype"], entry["shape"])
    with open(path, "rb") as f:
        if f.read(len(header)) != header:
            return f"has a .npy header other than {entry['dtype']}{entry['shape']}, which the index records"
    if not stat_vouches(recorded, st, entry["sha256"]):
        mtime_ns = recorded.get("mtime_ns") if isinstance(recorded, dict) else None
        return f"was modified after consolidation (mtime {st.st_mtime_ns} != {mtime_ns} recorded)"
    return None


def _hash_problem(path: Path, entry: dict) -> str | None:
    """Why a file's bytes differ from its index entry (sha256); None if they are the same."""
    digest = sha256_file(path)
    return None if digest == entry["sha256"] else \
        f"hashes to {digest[:12]}..., the index records {entry['sha256'][:12]}..."


# ------------------------------------------------------------------------------ helpers: writing


def _write_outputs(read_part: Callable, manifest: dict, parts: dict[str, PartInfo], out_dir: Path,
                   stale: list[str], index: dict | None, stats: dict[str, dict], *, seq: int,
                   check_space: bool) -> None:
    """Stream the stale outputs part by part through one AtomicWriter each; then the index, last."""
    out_dir.mkdir(parents=True, exist_ok=True)
    n, dtype = manifest["n_samples"], np.dtype(manifest["out_dtype"])
    shapes = {o: (n, *manifest["shapes"][o]) for o in stale}
    headers = {o: npy_header(dtype, shapes[o]) for o in stale}
    _remove_stale_temporaries(out_dir, manifest["outputs"])
    if check_space:
        _require_free_space(out_dir, {o: len(headers[o]) + math.prod(shapes[o]) * dtype.itemsize
                                      for o in stale})
    written: dict[str, WrittenFile] = {}
    if stale:
        with contextlib.ExitStack() as stack, os_errors_name(out_dir):   # leaving early discards the temporaries
            writers = {o: stack.enter_context(AtomicWriter(out_dir / f"{o}.npy")) for o in stale}
            for o, writer in writers.items():
                writer.write(headers[o])
            _stream_parts(read_part, manifest, writers, dtype)
            written = {o: writer.commit() for o, writer in writers.items()}
    files = dict(index["files"]) if index is not None else {}
    files.update({o: {"file": w.path.name, "bytes": w.bytes, "sha256": w.sha256, "dtype": dtype.name,
                      "shape": list(shapes[o])} for o, w in written.items()})
    files = {o: {k: v for k, v in e.items() if k != "mtime_ns"} for o, e in files.items()}   # layout 2's
    body = {"n_samples": n, "outputs": manifest["outputs"], "fingerprints": manifest["fingerprints"],
            "parts": {name: {"range": rng, "sha256": {o: parts[name].files[o].sha256
                                                      for o in manifest["outputs"]}}
                      for name, rng in manifest["parts"].items()},
            "files": files}
    write_manifest(out_dir / INDEX_NAME, INDEX_KIND, body, version=INDEX_VERSION, seq=seq)
    write_stat_cache(out_dir / INDEX_NAME, {**{o: stats[o] for o in files if o in stats and o not in written},
                                            **{o: {**w.stat_fingerprint(), "sha256": w.sha256}
                                               for o, w in written.items()}})


def _stream_parts(read_part: Callable, manifest: dict, writers: dict[str, AtomicWriter], dtype: np.dtype) -> None:
    """Append every part's rows, in sample order, to each output's writer (parts read once, verified)."""
    filled = 0
    for name, (start, stop) in manifest["parts"].items():
        if start != filled:
            raise StateError(f"{name} starts at sample {start:,}, the parts before it end at "
                             f"{filled:,}; the manifest is damaged: rerun encode to rebuild it")
        filled = stop
        arrays = read_part(name, mmap=True, verify=VerifyLevel.HASH)
        for o, writer in writers.items():
            part = arrays[o]
            if part.shape != (stop - start, *manifest["shapes"][o]) or part.dtype != dtype:
                raise StateError(f"{name}/{o} is {part.dtype}{list(part.shape)}, the manifest "
                                 f"expects {dtype}{[stop - start, *manifest['shapes'][o]]}; "
                                 f"delete the part and rerun encode to recompute it")
            writer.write(np.ascontiguousarray(part).reshape(-1).view(np.uint8))
        del arrays
    if filled != manifest["n_samples"]:
        raise StateError(f"the parts end at sample {filled:,} of {manifest['n_samples']:,}; the "
                         f"manifest is damaged: rerun encode to rebuild it")


def _require_free_space(out_dir: Path, sizes: dict[str, int]) -> None:
    """BudgetExceeded, with the bytes needed and free, when the outputs to write do not fit (the suite's rule and
    margin, `nblib.budget.resources.fits`).
    """
    need, free = sum(sizes.values()), disk_free(out_dir)
    if not fits(need, free):
        need_s, free_s = fmt_bytes_pair(need, free)
        raise BudgetExceeded(
            f"consolidating {', '.join(sizes)} into {out_dir} needs {need_s} ({need:,} bytes) but "
            f"{free_s} ({free:,} bytes) is free there, {shortfall_figure(need, free)} short {margin_words()}; free "
            f"space, pass out_dir on a larger disk, or keep fewer outputs. The parts are untouched: rerun "
            f"consolidate (or encode) afterwards")


def _remove_stale_temporaries(out_dir: Path, outputs: list[str]) -> None:
    """Delete temporaries a killed consolidate left behind (ours only: .tmp-<output>.npy.*)."""
    for o in outputs:
        for leftover in out_dir.glob(f"{TMP_PREFIX}{o}.npy.*"):
            leftover.unlink(missing_ok=True)
