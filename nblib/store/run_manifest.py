"""The run manifest of a store: one `nblib.manifest` record per side, the newest sequence wins.

The caller's dict is stored as the record's `run`; the mirror's copy also lists the parts
verified present on the mirror when it was written (`parts`), so a mirror that lost parts
never claims them. Both sides carry the same `seq`; a reader takes the highest valid one
(local on a tie), so a fresh machine with empty local staging resumes from the mirror.
"""
from __future__ import annotations

from pathlib import Path

from nblib.errors import ManifestDamaged
from nblib.manifest import Manifest, manifest_bytes, parse_manifest

from .parts import DamagedCopy, FileOps

__all__ = [
    "MANIFEST_FILE", "MANIFEST_KIND", "MANIFEST_VERSION", "newest", "read_run_manifest",
    "run_manifest_bytes",
]

MANIFEST_KIND = "nblib.store.run"    # the store's envelope around the caller's dict (not the run's kind:
MANIFEST_VERSION = 2                 # an encode run says its own, nblib.encode.layout.RUN_KIND, inside)
MANIFEST_FILE = "manifest.json"


def run_manifest_bytes(run: dict, seq: int, parts: list[str] | None = None) -> bytes:
    """The stored bytes of a run manifest: the caller's dict, the sequence, and (mirror) its parts."""
    body = {"run": run} if parts is None else {"run": run, "parts": sorted(parts)}
    return manifest_bytes(MANIFEST_KIND, body, version=MANIFEST_VERSION, seq=seq)


def read_run_manifest(ops: FileOps, root: Path, side: str) -> Manifest | DamagedCopy | None:
    """The verified run manifest under `root`, why it is damaged, or None when there is none."""
    raw = ops.read_bytes(root / MANIFEST_FILE)
    if raw is None:
        return None
    try:
        record = parse_manifest(raw, MANIFEST_KIND, versions=(MANIFEST_VERSION,), where=f"{side} {MANIFEST_FILE}")
    except ManifestDamaged as exc:
        return DamagedCopy(MANIFEST_FILE, side, str(exc))
    if not isinstance(record.body.get("run"), dict):
        return DamagedCopy(MANIFEST_FILE, side, "the record holds no run dict")
    return record


def newest(copies: list[Manifest]) -> Manifest | None:
    """The copy with the highest sequence number; the first listed (local) on a tie."""
    return max(copies, key=lambda copy: copy.seq, default=None)
