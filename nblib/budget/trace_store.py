"""The one trace cache: traced allocation streams keyed by what shapes a trace, in a per-user folder.

A traced stream (nblib.budget.encode_trace) depends on the spec it traced (model, precision, outputs, offload,
attention, GPU), on the torch that ran it (its operators and decompositions: major.minor, so Colab's
`2.13.0+cu126` and the CI's `2.13.0+cpu` are one torch), on `TRACE_FORMAT` (the stream's layout and the trace's
rules: raise it when nblib's trace changes what it records), and on this process's variables that shape a trace
(`nblib.budget.shim.traced_environment`, less those the spec already names). `entry_key` is their digest and an
entry's file name. An entry is read from the table shipped in the package (`SHIPPED`, tested live against a fresh
trace), else from the user's folder, else traced and written there (`save`): filled on first use. An entry of the
user's folder is keyed by nblib's own code too (`source_digest`): an upgraded or edited nblib traces again, never
replays a stream an older trace made.

A `--model` trace's result (nblib.budget.model_vram: the child's stream, or its points where the job is not affine
in the batch) is kept there too (`save_result`, `find_result`), keyed by the caller's key (the job, the model's
source, the traced batches) and the same torch, format, variables and nblib digest, with the sha256 of its result:
an entry that does not match is named in one warning line and traced again, never replayed. The `KEPT_RESULTS`
entries used last are kept (an entry read is touched); older ones, such as those of an nblib since edited, go.

The user's folder is `nblib.budget.user_cache.user_folder("traces")`, beside the fake-CUDA shim's library.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from nblib.atomic import atomic_write_bytes, sha256_json
from nblib.budget.user_cache import user_folder

log = logging.getLogger("nblib.budget")
SHIPPED = Path(__file__).parents[1] / "trace_seed"      # data only, shipped beside the Python (pyproject)
TRACE_FORMAT = 2            # 1: keyed by the spec and the full torch version; 2: this key
# named by the spec (the TRM's shape is in it, the preset that chose it is not needed; PYTHONPATH finds a user's
# module, and the TRM is nblib's own)
SPEC_NAMED_ENV = frozenset({"NBLIB_PROFILE", "PYTHONPATH"})
KEPT_RESULTS = 256          # --model traces kept in the user's folder (a ViT-B/16 training stream is ~2 MB)


def torch_release() -> str | None:
    """torch's major.minor ("2.13"): the imported torch's __version__, else the installed one's; None without it."""
    module = sys.modules.get("torch")
    full = getattr(module, "__version__", None) if module is not None else None
    if full is None:
        try:
            full = version("torch")
        except PackageNotFoundError:
            return None
    return ".".join(str(full).split("+")[0].split(".")[:2])


def shaping_environment() -> dict[str, str]:
    """The variables of this process that shape a TRM trace: `traced_environment` less `SPEC_NAMED_ENV`."""
    from nblib.budget.shim import traced_environment

    return {k: v for k, v in sorted(traced_environment().items()) if k not in SPEC_NAMED_ENV}


def entry_key(spec: dict, torch: str | None, env: dict | None = None) -> dict:
    """What an entry is keyed by: the spec, torch's major.minor, the trace format, the shaping variables."""
    return {"spec": spec, "torch": torch, "format": TRACE_FORMAT,
            "env": shaping_environment() if env is None else env}


def user_key(key: dict) -> dict:
    """The key of an entry in the user's folder: `entry_key` and the digest of nblib's code that traced it."""
    return {**key, "nblib": source_digest()}


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """sha256 of nblib's Python sources (each file's path below the package and its bytes), 16 hex digits."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def entry_name(key: dict, kind: str = "trm-encode") -> str:
    """An entry's file name: `kind` (a TRM encode trace, or a --model trace: "model") and the key's digest."""
    return f"{kind}-{sha256_json(key)[:12]}.json"


def find(spec: dict) -> tuple[dict, Path] | None:
    """(entry, its file) for `spec` under this torch and environment: the shipped table's, else the user
    folder's; None where neither holds it. Without torch, the shipped table's entry under any torch.
    """
    torch = torch_release()
    key = entry_key(spec, torch)
    if torch is None:
        return _first(sorted(SHIPPED.glob("trm-encode-*.json")), key, any_torch=True)
    # the user's folder is made (and checked) only when the shipped table has no entry
    mine = user_key(key)
    return _first([SHIPPED / entry_name(key)], key) or _first([user_folder("traces") / entry_name(mine)], mine)


def _first(paths, key: dict, any_torch: bool = False) -> tuple[dict, Path] | None:
    """The first of `paths` that holds an entry whose head is `key` (any torch's where `any_torch`)."""
    for path in paths:
        entry = _read(path)
        if entry is not None and all(entry["head"].get(k) == v for k, v in key.items()
                                     if not (any_torch and k == "torch")):
            return entry, path
    return None


def _read(path: Path, body: str = "stream") -> dict | None:
    """An entry file, or None where it is absent or not one (a half-written or foreign file is never used)."""
    try:
        entry = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    ok = isinstance(entry, dict) and isinstance(entry.get("head"), dict) and body in entry
    return entry if ok and (body != "stream" or isinstance(entry["stream"], list)) else None


def save(entry_text: str, key: dict) -> Path:
    """Write an entry (its head: `user_key(key)`) into the user folder atomically."""
    return _write(user_folder("traces") / entry_name(user_key(key)), entry_text)


def find_result(key: dict) -> dict | None:
    """The kept result of a --model trace under `key` (`entry_key` of the caller's key) in the user's folder; None
    where there is none, or (with one warning line) where its file is not an intact entry of this key.
    """
    head = json.loads(json.dumps(user_key(key)))            # as its file holds it (a tuple is a list)
    path = user_folder("traces") / entry_name(head, "model")
    if not path.exists():
        return None
    entry = _read(path, "result")
    result = entry and entry.get("result")
    intact = isinstance(result, dict) and entry.get("sha256") == sha256_json(result)
    if not (entry and entry["head"] == head and intact):
        log.warning("the kept trace %s is damaged or not this job's: ignored, the model is traced again", path)
        return None
    os.utime(path)                                          # used now: kept longest
    return result


def save_result(key: dict, result: dict) -> Path:
    """Keep a --model trace's `result` under `key` in the user's folder (head, sha256 of the result, result)."""
    head = user_key(key)
    text = json.dumps({"head": head, "sha256": sha256_json(result), "result": result}, sort_keys=True)
    path = _write(user_folder("traces") / entry_name(head, "model"), text)
    entries = sorted(path.parent.glob("model-*.json"), key=_used, reverse=True)
    for old in entries[KEPT_RESULTS:]:                      # the least recently used beyond KEPT_RESULTS
        old.unlink(missing_ok=True)
    return path


def _used(path: Path) -> int:
    """When an entry was last written or read (0 where another process just removed it)."""
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return 0


def _write(path: Path, text: str) -> Path:
    """Write `text` to `path` atomically (nblib.atomic: a temporary file beside it, fsync, then os.replace)."""
    atomic_write_bytes(path, text.encode("utf-8"))
    return path
