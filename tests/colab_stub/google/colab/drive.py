"""A stand-in for `google.colab.drive`: mount a temporary folder as `<mountpoint>/MyDrive`, with faults.

`mount` makes `<mountpoint>` a symlink to `<home>/drive` (the "cloud": `<home>/drive/MyDrive`),
where `<home>` is `COLAB_STUB_HOME` (created under the temp dir and exported when unset, so child
processes share it). It prints what the real one prints, refuses a non-empty mountpoint, and on a
second call without `force_remount` says the drive is already mounted. `flush_and_unmount`
removes the mountpoint's link.

Faults are words in the control file `<home>/control`, so a test can set them from another
process (the kernel's parent); `control()` edits them:
    disconnected  every file operation under a mounted folder raises OSError(107, "Transport
                  endpoint is not connected"), like a dead FUSE mount, until a forced remount
    reauth        `mount` blocks, like a mount waiting for the user to re-authorize Drive, until
                  the word is removed (or `timeout_ms` passes: ValueError, as the real one)
The faults are raised by an audit hook (sys.addaudithook) on `open` and the `os.*` / `shutil.*`
events (listdir, scandir, rename, remove, mkdir, rmdir, ...); `os.stat` has no audit event, so a
stat still answers. The hook is installed at the first mount and does nothing while no folder is
mounted in this process.
"""
from __future__ import annotations

import errno
import os
import sys
import tempfile
import threading
import time

HOME_ENV = "COLAB_STUB_HOME"
WORDS = ("disconnected", "reauth")
POLL_S = 0.05

_mounts: set[str] = set()          # mountpoints mounted by this process (absolute, unresolved)
_prefixes: tuple[str, ...] = ()    # what the hook guards: the mountpoints and the backing folder
_hook_installed = False
_lock = threading.Lock()
_cache: tuple[tuple, frozenset] = ((), frozenset())


def mount(mountpoint, force_remount=False, timeout_ms=120000, readonly=False):
    """Mount the stub Drive at `mountpoint` (blocks while the control file says `reauth`)."""
    mountpoint = os.path.abspath(os.fspath(mountpoint))
    backing = _backing()
    if _is_ours(mountpoint, backing) and mountpoint in _mounts and not force_remount:
        print(f"Drive already mounted at {mountpoint}; to attempt to forcibly remount, call "
              f'drive.mount("{mountpoint}", force_remount=True).')
        return
    _wait_for_authorization(timeout_ms)
    if not _is_ours(mountpoint, backing):
        if os.path.islink(mountpoint):
            os.unlink(mountpoint)
        elif os.path.isdir(mountpoint):
            if os.listdir(mountpoint):
                raise ValueError("Mountpoint must not already contain files")
            os.rmdir(mountpoint)
        elif os.path.exists(mountpoint):
            raise ValueError("Mountpoint must be in a directory that exists")
        os.makedirs(os.path.dirname(mountpoint), exist_ok=True)
        os.symlink(backing, mountpoint)
    control(disconnected=False)
    with _lock:
        _mounts.add(mountpoint)
        _guard()
    print(f"Mounted at {mountpoint}")


def flush_and_unmount(timeout_ms=86400000):
    """Unmount every folder this process mounted (the link goes; the files stay in the stub's cloud)."""
    with _lock:
        mounted = sorted(_mounts)
        _mounts.clear()
        _guard()
    if not mounted:
        raise ValueError("Drive not mounted, so nothing to flush and unmount.")
    for mountpoint in mounted:
        if os.path.islink(mountpoint):
            os.unlink(mountpoint)
    print("All changes made in this colab session should now be visible in Drive.")


def control(**words: bool) -> frozenset:
    """Set (True) or clear (False) fault words in the control file; the words now set.

    control(disconnected=True): the next file operation under the mount raises Errno 107.
    control(reauth=True): the next mount blocks until control(reauth=False).
    """
    unknown = set(words) - set(WORDS)
    if unknown:
        raise ValueError(f"unknown control words {sorted(unknown)}; use {WORDS}")
    path = control_file()
    now = set(faults())
    now |= {w for w, on in words.items() if on}
    now -= {w for w, on in words.items() if not on}
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}"
    with open(tmp, "w") as f:
        f.write("\n".join(sorted(now)))
    os.replace(tmp, path)
    return frozenset(now)


def faults() -> frozenset:
    """The fault words the control file holds now."""
    global _cache
    path = control_file()
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return frozenset()
    key = (st.st_ino, st.st_mtime_ns, st.st_size)
    if _cache[0] == key:
        return _cache[1]
    with open(path) as f:
        words = frozenset(w for w in f.read().split() if w in WORDS)
    _cache = (key, words)
    return words


def home() -> str:
    """The stub's folder (COLAB_STUB_HOME): `drive/MyDrive` is the cloud, `control` the fault words."""
    path = os.environ.get(HOME_ENV)
    if not path:
        path = os.environ[HOME_ENV] = tempfile.mkdtemp(prefix="colab-stub-")
    return path


def control_file() -> str:
    return os.path.join(home(), "control")


# ---------------------------------------------------------------------------------- helpers


def _backing() -> str:
    backing = os.path.join(home(), "drive")
    if not os.path.isdir(os.path.join(backing, "MyDrive")):
        os.makedirs(os.path.join(backing, "MyDrive"))
    return backing


def _is_ours(mountpoint: str, backing: str) -> bool:
    return os.path.islink(mountpoint) and os.path.realpath(mountpoint) == os.path.realpath(backing)


def _wait_for_authorization(timeout_ms) -> None:
    deadline = time.monotonic() + timeout_ms / 1000
    while "reauth" in faults():
        if time.monotonic() > deadline:
            raise ValueError("mount failed: timed out waiting for Drive authorization")
        time.sleep(POLL_S)


def _guard() -> None:
    """Point the audit hook at the mounted folders (called with _lock held)."""
    global _prefixes, _hook_installed
    if _mounts:
        _prefixes = tuple(p + os.sep for p in (*_mounts, os.path.realpath(_backing())))
    else:
        _prefixes = ()
    if _mounts and not _hook_installed:
        sys.addaudithook(_audit)
        _hook_installed = True


def _audit(event: str, args: tuple) -> None:
    prefixes = _prefixes
    if not prefixes or not (event == "open" or event.startswith(("os.", "shutil."))):
        return
    for arg in args:
        if isinstance(arg, (str, bytes, os.PathLike)) and _under(arg, prefixes) and "disconnected" in faults():
            raise OSError(errno.ENOTCONN, "Transport endpoint is not connected", os.fsdecode(arg))


def _under(arg, prefixes: tuple[str, ...]) -> bool:
    try:
        path = os.path.abspath(os.fsdecode(arg)) + os.sep
    except (TypeError, ValueError):
        return False
    return path.startswith(prefixes)
