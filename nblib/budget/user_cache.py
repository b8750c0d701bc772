"""nblib's per-user folder: mode 0700, refused when another user owns it or it is a link.

platformdirs' user_cache_dir("nblib") where platformdirs is installed, else $XDG_CACHE_HOME/nblib or
~/.cache/nblib. It holds the trace cache (nblib.budget.trace_store) and the fake-CUDA shim's compiled library
(nblib.budget.shim.shim_path), never at a fixed name in the shared temp folder, where another local user could
plant a library of that name for this process to load.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

from nblib.errors import ConfigError


def user_folder(*parts: str) -> Path:
    """The per-user folder (and `parts` below it), made mode 0700; ConfigError where another user owns it, it is
    a link, or it cannot be made (a read-only home).
    """
    try:
        from platformdirs import user_cache_dir
        root = Path(user_cache_dir("nblib", appauthor=False))
    except ImportError:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "nblib"
    folder = root.joinpath(*parts)
    for path in (root, *(root.joinpath(*parts[:i + 1]) for i in range(len(parts)))):
        _own_folder(path)               # each level checked before anything is made below it
    return folder


def _own_folder(path: Path) -> None:
    """Make `path` (mode 0700) or find it; ConfigError unless it is a folder of this user's, not a link."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            path.mkdir(mode=0o700)
        except FileExistsError:
            pass
        st = os.lstat(path)
    except OSError as exc:
        raise ConfigError(f"nblib's per-user folder {path} cannot be made ({exc.strerror}); set XDG_CACHE_HOME to "
                          f"a folder of your own that can be written") from None
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise ConfigError(f"nblib's per-user folder {path} is a link, not a folder, or belongs to uid {st.st_uid}, "
                          f"not to this user (uid {os.getuid()}): nothing is read from it; remove it, or set "
                          f"XDG_CACHE_HOME to a folder of your own")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)


def compiled_library(source: Path, stem: str) -> Path:
    """The shared library of the C file `source`, compiled once (cc -O2) into this per-user folder's "lib", named
    by `stem` and a hash of the source and the compiler (never a fixed name in a shared folder); ConfigError when
    no C compiler ($CC, cc or gcc) builds it.
    """
    import hashlib
    import shutil

    text = source.read_bytes()
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise ConfigError(f"no C compiler ($CC, cc or gcc) to build {source.name}; install one (apt-get install gcc)")
    out = user_folder("lib") / f"{stem}-{hashlib.sha256(text + cc.encode()).hexdigest()[:16]}.so"
    return built_once(out, lambda tmp, built: [cc, "-O2", "-shared", "-fPIC", "-o", str(built), str(source)],
                      source.name)


def built_once(out: Path, command, what: str, error: type[Exception] = ConfigError) -> Path:
    """`out`, built once: `command(folder, built)` gives the compiler's arguments that write `built` (`folder`: a
    temporary folder beside `out`, for its inputs), and `built` then moves onto `out`; `error` naming `what`, the
    compiler and its last line when it does not compile.
    """
    import subprocess
    import tempfile

    if out.exists():
        return out
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        built = Path(tmp) / out.name
        args = command(Path(tmp), built)
        try:
            done = subprocess.run(args, capture_output=True, text=True)
        except OSError as exc:             # the compiler names no program
            raise error(f"{what} did not compile with {args[0]}: {exc.strerror}") from None
        if done.returncode:
            why = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise error(f"{what} did not compile with {args[0]}: {why}")
        os.replace(built, out)             # same filesystem: atomic; a concurrent build writes the same bytes
    return out
