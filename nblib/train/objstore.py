"""Object storage (s3://, gs://, any fsspec URL) as the mirror's FileOps: the Drive machinery, a bucket behind it.

`mirror_target(url_or_dir)` gives (root, ops) for the store's `Mirror` thread: a plain folder keeps the real
filesystem calls, a URL gets `FsspecOps`. Object stores have no rename: `write_atomic` checks the bytes'
digest, then PUTs them in one request. `check_run_folders` refuses, before a run writes, a mirror that would
be no second copy, folders nested in one another, and a bucket that does not exist (the mirror never creates
one: a mistyped name would be created silently). Clients, credentials and timeouts: "Object storage" in
docs/training.md. Trade-off: short timeouts, so a stalled bucket fails an attempt the mirror retries later
instead of holding its thread for minutes. `gs://` uses gcsfs's JSON-API filesystem, not the experimental
layer that first asks the gRPC storage-control API for the bucket's layout (zonal buckets are not supported).
"""
from __future__ import annotations

import errno
import functools
import itertools
import logging
import os
import re
from pathlib import Path, PurePosixPath

from nblib.atomic import WrittenFile, algorithm_of, digest_bytes, torch_zip_crc32
from nblib.disk import overlap
from nblib.errors import ConfigError, InputError, StateError
from nblib.store.parts import CHECKPOINT_HASH, FileOps

URL = re.compile(r"^([a-z][a-z0-9+.-]*)://(.+)$")
PACKAGES = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs"}
CONNECT_S, READ_S, ATTEMPTS = 5, 30, 2
LOOKS_LIKE_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):/")
MIRROR_PROTOCOLS = tuple(PACKAGES)          # object stores a mirror may use; anything else is a folder or refused
SUPPORTED = "a folder (Google Drive: /content/drive/MyDrive/RUN), s3://BUCKET/PREFIX or gs://BUCKET/PREFIX"
log = logging.getLogger(__name__)
DEFAULT_S3_CONFIG = {"connect_timeout": CONNECT_S, "read_timeout": READ_S, "retries": {"max_attempts": ATTEMPTS}}


def is_url(target: str | Path) -> bool:
    return isinstance(target, str) and URL.match(target) is not None


def mirror_target(target: str | Path, storage_options: dict | None = None) -> tuple[Path, FileOps]:
    """(root, ops) for a mirror folder or an object-store URL."""
    if not is_url(target):
        return Path(target), FileOps()
    protocol, rest = URL.match(target).groups()
    return Path(PurePosixPath(rest.rstrip("/"))), FsspecOps(open_filesystem(protocol, storage_options), target)


def check_run_folders(cache_dir: str | Path, out: str | Path, mirror: str | Path | None = None, *,
                      storage_options: dict | None = None, timeout_s: float = 60.0, data_flag: str = "--cache") -> None:
    """ConfigError unless the data (`data_flag`: --cache or --records), the run folder and the mirror are
    three places, none inside another, and the mirror is a durable second copy (a folder, or a bucket that
    exists). See the module docstring.
    """
    folders = {data_flag: Path(cache_dir), "--out": Path(out)}
    if mirror is not None:
        check_mirror_name(mirror)
        if not is_url(mirror):
            folders["--mirror"] = Path(mirror)
    _refuse_nesting(folders)
    if mirror is not None and is_url(mirror):
        check_bucket_exists(str(mirror), storage_options, timeout_s)


def check_mirror_name(mirror: str | Path) -> None:
    """ConfigError for a mirror name that is no second copy: empty, a URL with no bucket, `memory://`, or a
    protocol the mirror does not speak (ftp://, http://, file://, ...).
    """
    text = str(mirror)
    if not text.strip():
        raise ConfigError(f"--mirror {text!r} is empty: it would mirror into the current folder, not a second "
                          f"copy; pass {SUPPORTED}, or leave --mirror out")
    shaped = LOOKS_LIKE_URL.match(text)
    if shaped is None and not is_url(text):
        return
    protocol = shaped.group(1).lower() if shaped else URL.match(text).group(1)
    if protocol == "memory":
        raise ConfigError(f"--mirror {text} lives in this process's memory and dies with it: not a second copy; "
                          f"pass {SUPPORTED}")
    if protocol not in MIRROR_PROTOCOLS:
        hint = (f"pass the folder itself ({text.split('://', 1)[-1] or '/PATH'})" if protocol in ("file", "local")
                else f"pass {SUPPORTED}")
        raise ConfigError(f"--mirror {text}: the mirror does not write to {protocol}://; {hint}")
    match = URL.match(text)
    if match is None or not match.group(2).strip("/"):
        raise ConfigError(f"--mirror {text} names no bucket (it would become a local folder named "
                          f"{text.split('/')[0]!r}); pass {protocol}://BUCKET/PREFIX")


def check_bucket_exists(url: str, storage_options: dict | None = None, timeout_s: float = 60.0) -> None:
    """InputError when the store answers that the bucket of `url` does not exist (s3://, gs://).

    Any other outcome lets the run start: the bucket exists, or the store cannot be reached now (a dead
    or stalled endpoint, refused credentials), in which case the mirror retries later and the run's
    durability line says what is not yet mirrored; the check waits at most `timeout_s`.
    """
    from nblib.store.deadline import call_within

    protocol, rest = URL.match(url).groups()
    bucket = rest.split("/", 1)[0]
    if protocol not in ("s3", "s3a", "gs", "gcs"):
        return
    try:
        fs = open_filesystem(protocol, storage_options)
        ask = ((lambda: fs.call_s3("head_bucket", Bucket=bucket)) if protocol in ("s3", "s3a")
               else (lambda: fs.info(bucket)))
        call_within(ask, timeout_s, what=f"the bucket {protocol}://{bucket}", thread_name="nblib-bucket-check")
    except FileNotFoundError:
        raise InputError(f"--mirror {url}: the bucket {protocol}://{bucket} does not exist (the store answered "
                         f"404, no such bucket); check its name, or create it first (the mirror never creates "
                         f"a bucket)") from None
    except ConfigError:
        raise
    except Exception as exc:  # cannot reach or may not look: the mirror retries while training goes on
        log.warning("could not check that the bucket %s://%s exists (%s: %s); training goes on and the "
                    "mirror retries", protocol, bucket, type(exc).__name__, str(exc)[:200])


def _refuse_nesting(folders: dict[str, Path]) -> None:
    """ConfigError naming two of the run's folders that are one folder, or one inside the other."""
    resolved = {flag: path.expanduser().resolve() for flag, path in folders.items()}
    for a, b in itertools.combinations(resolved, 2):
        how = overlap(resolved[a], resolved[b])
        if how == "is":
            raise ConfigError(f"{a} and {b} are the same folder ({resolved[a]}): {_why(b, a, same=True)}; "
                              f"pass another {b}")
        if how is not None:
            inner, outer = (a, b) if how == "sits inside" else (b, a)
            raise ConfigError(f"{inner} {resolved[inner]} is inside {outer} {resolved[outer]}: "
                              f"{_why(inner, outer)}; keep them side by side (e.g. work/cache, work/run, "
                              f"/content/drive/MyDrive/run)")


def _why(inner: str, outer: str, same: bool = False) -> str:
    """Why `inner` may not be (inside) `outer`."""
    if same and "--mirror" in (inner, outer):
        return "the mirror would be no second copy of the run"
    if inner == "--out" and outer in ("--cache", "--records"):
        return "the run would write its checkpoints, final.pt and train.json among the cache's shards"
    return (f"losing {outer}, or removing it for a fresh start (as a refused resume advises), would take "
            f"{inner} with it")


def open_filesystem(protocol: str, storage_options: dict | None = None):
    """fsspec's filesystem for `protocol`, with listing caches off and short timeouts (S3, GCS)."""
    import fsspec

    options = {"use_listings_cache": False, "skip_instance_cache": True, **(storage_options or {})}
    if protocol in ("s3", "s3a"):
        options.setdefault("config_kwargs", DEFAULT_S3_CONFIG)
    elif protocol == "memory":
        options = {}
    try:
        if protocol in ("gs", "gcs"):
            return gcs_filesystem(options)
        return fsspec.filesystem(protocol, **options)
    except (ImportError, ValueError) as exc:
        package = PACKAGES.get(protocol)
        hint = (f"install {package} (pip install {package}) to mirror to {protocol}://" if package
                else f"fsspec knows no protocol {protocol!r}; use s3://, gs:// or a folder")
        raise ConfigError(f"cannot open {protocol}:// ({type(exc).__name__}: {exc}); {hint}") from None


def gcs_filesystem(options: dict):
    """gcsfs's JSON-API filesystem: 2 attempts, connect 5 s, read 30 s; anonymous against an emulator.

    An endpoint (`endpoint_url`, or STORAGE_EMULATOR_HOST as google-cloud-storage reads it) with no
    `token` means a local emulator: no credential lookup (gcloud, then the GCE metadata server).
    gcsfs logs each failed request with a traceback; the mirror reports failures itself (its
    retries, the run's durability line), so the `gcsfs` logger is quieted unless its level was set.
    """
    import aiohttp

    if logging.getLogger("gcsfs").level == logging.NOTSET:
        logging.getLogger("gcsfs").setLevel(logging.CRITICAL)
    options = dict(options)
    if options.get("endpoint_url") or os.environ.get("STORAGE_EMULATOR_HOST", "") not in ("", "default"):
        options.setdefault("token", "anon")
    options.setdefault("requests_timeout", aiohttp.ClientTimeout(total=None, connect=CONNECT_S, sock_read=READ_S))
    return _gcs_class()(**options)


@functools.cache
def _gcs_class():
    """GCSFileSystem whose requests make ATTEMPTS tries (gcsfs fixes 6, with up to 31 s of backoff).

    A gcsfs whose `_request` is not the decorated coroutine of 2026.8 (an older one Colab may ship)
    keeps its own retries: slower to give up, the same results.
    """
    from gcsfs.core import GCSFileSystem
    from gcsfs.retry import retry_request

    undecorated = getattr(GCSFileSystem._request, "__wrapped__", None)
    if undecorated is None:
        return GCSFileSystem

    class ShortRetryGCSFileSystem(GCSFileSystem):
        retries = ATTEMPTS
        _request = retry_request(retries=ATTEMPTS)(undecorated)

    return ShortRetryGCSFileSystem


class FsspecOps(FileOps):
    """FileOps over an fsspec filesystem: paths are 'bucket/prefix/name' (no protocol).

    Client errors that are not OSErrors (botocore's EndpointConnectionError, ClientError, ...)
    become OSError(EIO) naming the bucket, so the mirror retries them as it retries Drive.
    """

    def __init__(self, fs, label: str):
        self.fs, self.label = fs, label
        for name in ("open", "listdir", "is_dir", "stat", "makedirs", "unlink", "replace", "read_bytes",
                     "write_atomic", "create_exclusive", "load_torch", "write_torch"):
            setattr(self, name, _as_oserror(getattr(self, name), self.label))

    def open(self, path, mode="rb"):
        return self.fs.open(str(path), mode)

    def listdir(self, path) -> list[str]:
        entries = self.fs.ls(str(path), detail=False)
        if not entries and not self.fs.exists(str(path)):
            raise FileNotFoundError(2, "no such prefix", str(path))
        return sorted({PurePosixPath(e).name for e in entries})

    def is_dir(self, path) -> bool:
        return bool(self.fs.isdir(str(path)))

    def stat(self, path):
        info = self.fs.info(str(path))
        return _Stat(int(info.get("size") or 0))

    def makedirs(self, path) -> None:
        pass                                  # prefixes need no folder; never create a bucket (a typo would be)

    def unlink(self, path) -> None:
        if not self.fs.exists(str(path)):
            raise FileNotFoundError(2, "no such object", str(path))
        self.fs.rm_file(str(path))

    def rmdir(self, path) -> None:
        pass                                  # prefixes vanish with their last object

    def replace(self, src, dst) -> None:
        self.fs.mv(str(src), str(dst))

    def fsync_dir(self, path) -> None:
        pass                                  # a completed PUT is durable

    def read_bytes(self, path) -> bytes | None:
        try:
            return self.fs.cat_file(str(path))
        except FileNotFoundError:
            return None

    def load_torch(self, path, nbytes: int, digest: str, map_location="cpu", weights_only: bool = True):
        """One GET of the object, checked against its record (size, digest), then torch.load from memory."""
        import io

        import torch

        data = self.read_bytes(path)
        if data is None or len(data) != nbytes:
            got = 0 if data is None else len(data)
            raise StateError(f"{Path(path).name} has {got} bytes, its record says {nbytes}")
        if digest_bytes(data, algorithm_of(digest)) != digest:
            raise StateError(f"{algorithm_of(digest)} differs from its record")
        return torch.load(io.BytesIO(data), map_location=map_location, weights_only=weights_only)

    def write_torch(self, path, obj, *, sync_dir: bool = True) -> WrittenFile:
        """torch.save into memory (a checkpoint: no zip CRCs, CHECKPOINT_HASH), then one PUT."""
        import io

        import torch

        buffer = io.BytesIO()
        with torch_zip_crc32(False):
            torch.save(obj, buffer)
        return self.write_atomic(path, [buffer.getbuffer()], algorithm=CHECKPOINT_HASH)

    def create_exclusive(self, path, data: bytes) -> None:
        """Create the object `path` unless it exists (FileExistsError): a conditional PUT (If-None-Match)
        where the filesystem has one (s3fs), else a check then a PUT (a narrow race another claim loses
        at its next check).
        """
        try:
            with self.fs.open(str(path), "xb") as f:
                f.write(data)
            return
        except (NotImplementedError, ValueError, TypeError):
            pass                                  # no exclusive mode in this filesystem
        if self.fs.exists(str(path)):
            raise FileExistsError(17, "object exists", str(path))
        self.fs.pipe_file(str(path), data)

    def write_atomic(self, path, blocks, expect_digest: str | None = None, *,
                     algorithm: str = "sha256") -> WrittenFile:
        """One PUT of the whole object, after its digest matched `expect_digest` (if given; its algorithm)."""
        blocks = list(blocks)
        data = bytes(blocks[0]) if len(blocks) == 1 else b"".join(bytes(b) for b in blocks)
        digest = digest_bytes(data, algorithm_of(expect_digest) if expect_digest is not None else algorithm)
        if expect_digest is not None and digest != expect_digest:
            raise ValueError(f"{Path(path).name}: the bytes hash to {digest[:21]}..., expected {expect_digest[:21]}...")
        self.fs.pipe_file(str(path), data)
        return WrittenFile(Path(path), len(data), digest, 0)


def _as_oserror(fn, label: str):
    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (OSError, ValueError):
            raise
        except Exception as exc:
            raise OSError(errno.EIO, f"{label}: {type(exc).__name__}: {str(exc)[:300]}") from exc
    return call


class _Stat:
    """The fields of os.stat_result the store reads from an object (size; objects are not folders)."""

    def __init__(self, size: int):
        self.st_size, self.st_mode, self.st_mtime_ns = size, 0o100644, 0
