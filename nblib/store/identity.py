"""Which run a mirror folder belongs to: `mirror.json`, written on first use, checked before every copy.

The first run to use a mirror claims it with an O_EXCL create holding its identity; another identity
is refused at start and never copied over, and a resume of the same run from a fresh local folder is
welcome (why, and what each case looks like: docs/failures.md, the `--mirror` rows).
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from pathlib import Path

from nblib.errors import ResumeMismatch

from .parts import FileOps

IDENTITY_FILE = "mirror.json"
KIND = "nblib.store.mirror-identity"
READ_TRIES = 20          # a claim being written by another process reads as empty: wait for it
READ_PAUSE_S = 0.05
SHOWN = 4                # differences a refusal names (then "and N more")


class ForeignMirror(ResumeMismatch):
    """The mirror folder belongs to another run: nothing of this run is copied there."""


def claim(ops: FileOps, root: Path, identity: dict, local_dir: Path) -> None:
    """Claim `root` for `identity`, or check an existing claim; ForeignMirror when it is another run's."""
    record = read_claim(ops, root)
    if record is None:
        ops.makedirs(root)
        mine = {"kind": KIND, "identity": identity, "local_dir": str(local_dir), "host": socket.gethostname(),
                "pid": os.getpid(), "claimed_at": time.time()}
        with contextlib.suppress(FileExistsError):   # lost the race: the other claim is checked below
            ops.create_exclusive(root / IDENTITY_FILE, json.dumps(mine, sort_keys=True).encode())
        record = read_claim(ops, root)
    require_same(record, identity, root)


def read_claim(ops: FileOps, root: Path) -> dict | None:
    """The claim record of a mirror folder, None when unclaimed (a half-written claim is waited for)."""
    raw = b""
    for _ in range(READ_TRIES):
        raw = ops.read_bytes(root / IDENTITY_FILE)
        if raw is None:
            return None
        try:
            record = json.loads(raw)
        except ValueError:
            time.sleep(READ_PAUSE_S)             # another process is writing its claim right now
            continue
        if isinstance(record, dict) and record.get("kind") == KIND and isinstance(record.get("identity"), dict):
            return record
        break
    raise ForeignMirror(f"the mirror folder {root} has a {IDENTITY_FILE} that is not a run claim "
                        f"({raw[:60]!r}); pass another --mirror, or delete that file if the folder holds "
                        f"nothing you need")


def require_same(record: dict | None, identity: dict, root: Path) -> None:
    """ForeignMirror naming the mirror folder and what differs, unless `record` claims it for `identity`."""
    if record is None or record["identity"] == identity:
        return
    from nblib.models.identity import dict_changes

    theirs = record["identity"]
    changed = [change for k in sorted(set(theirs) | set(identity), key=str)
               for change in dict_changes(k, theirs.get(k), identity.get(k))]
    changed = changed[:SHOWN] + ([f"and {len(changed) - SHOWN} more"] if len(changed) > SHOWN else [])
    raise ForeignMirror(
        f"the mirror folder {root} belongs to another run (first used from {record.get('local_dir')} on host "
        f"{record.get('host')}; it differs in {'; '.join(changed)}): two runs in one mirror folder would "
        f"overwrite each other's parts; pass another --mirror (one folder per run), or delete {root} if that run is no "
        f"longer needed")
