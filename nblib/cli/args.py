"""What every verb shares: argparse types that refuse bad values in one line, and OSErrors named."""
from __future__ import annotations

import argparse
import errno
import os

from nblib.config import SEED_LIMIT
from nblib.errors import ConfigError


def describe_os_error(exc: OSError) -> str:
    """One line for an OSError: the path, what the errno means, and what to do."""
    what = os.strerror(exc.errno) if exc.errno else str(exc)
    where = exc.filename if exc.filename is not None else "a file"
    advice = {
        errno.ENOSPC: "free space on that disk (or point the output elsewhere), then rerun the "
                      "same command: finished work is kept and resumed",
        errno.EDQUOT: "free quota on that disk, then rerun the same command to resume",
        errno.EROFS: "that file system is read-only: choose a writable folder",
        errno.EACCES: "you may not write there: choose a folder you own, or fix its permissions",
        errno.EPERM: "you may not write there: choose a folder you own, or fix its permissions",
        errno.ENOTDIR: "a path that should be a folder is a file: choose a folder",
        errno.EISDIR: "a path that should be a file is a folder: choose a file",
        errno.ENOENT: "it does not exist: check the path",
        errno.ENOTCONN: "the mount is disconnected (Drive): remount it, then rerun to resume",
        errno.EIO: "an I/O error: check the disk or mount, then rerun to resume",
    }.get(exc.errno, "fix the cause, then rerun the same command to resume")
    return f"{where}: {what} (errno {exc.errno}); {advice}"


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive integer")
    return value


def finite_positive_float(text: str) -> float:
    """argparse type: a finite number > 0 (refuses inf and nan)."""
    value = float(text)
    if not (value > 0 and value != float("inf")):
        raise argparse.ArgumentTypeError(f"{text} is not a finite number above 0")
    return value


def seed_int(text: str) -> int:
    """argparse type: a seed, an integer in [0, 2**64)."""
    value = int(text)
    if not 0 <= value < SEED_LIMIT:
        raise argparse.ArgumentTypeError(f"{text:.40} is not a seed: use an integer from 0 to 2**64 - 1 "
                                         f"({SEED_LIMIT - 1:,})")
    return value


def bounded_float(low: float, high: float, unit: str):
    """argparse type: a finite number in [low, high] (refuses inf, nan and absurd magnitudes)."""
    def parse(text: str) -> float:
        value = float(text)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{text:.40} is not a number from {low:g} to {high:g} {unit}")
        return value
    return parse


def parse_or_refuse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Parse flags; a bad value is a ConfigError (one `error:` line, exit 2), not argparse's usage dump."""
    try:
        return parser.parse_args(argv)
    except argparse.ArgumentError as exc:
        raise ConfigError(f"{exc}; see {parser.prog} --help") from None
