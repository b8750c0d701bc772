"""Units: byte, rate and duration constants and formatters (decimal units, as disks are sold)."""
from __future__ import annotations

KB, MB, GB, TB = 1e3, 1e6, 1e9, 1e12
KiB, MiB, GiB = 2**10, 2**20, 2**30

_BYTE_UNITS = (("TB", TB), ("GB", GB), ("MB", MB), ("KB", KB))


def fmt_bytes(n: float | None, digits: int = 2) -> str:
    """`n` bytes in the largest decimal unit it reaches, e.g. '1.75 GB'; '-' for None."""
    if n is None:
        return "-"
    for unit, size in _BYTE_UNITS:
        if abs(n) >= size:
            return f"{n / size:.{digits}f} {unit}"
    return f"{n:.0f} B"


def fmt_bytes_pair(a: float, b: float) -> tuple[str, str]:
    """Two byte counts in one unit, with enough digits that different numbers read differently."""
    unit, size = next(((u, s) for u, s in _BYTE_UNITS if max(abs(a), abs(b)) >= s), ("B", 1))
    for digits in range(2, 10):
        sa, sb = f"{a / size:.{digits}f}", f"{b / size:.{digits}f}"
        if a == b or sa != sb:
            return f"{sa} {unit}", f"{sb} {unit}"
    return f"{a:.0f} B", f"{b:.0f} B"


def fmt_gb(n: float | None, digits: int = 1) -> str:
    """`n` bytes in GB with `digits` decimals; '-' for None."""
    return "-" if n is None else f"{n / GB:.{digits}f} GB"


def fmt_rate(per_second: float, unit: str = "samples") -> str:
    """A rate such as '345.2 samples/s' (three significant digits at least)."""
    return f"{per_second:,.1f} {unit}/s" if per_second < 1000 else f"{per_second:,.0f} {unit}/s"


def fmt_duration(seconds: float) -> str:
    """Seconds as '42.0 s', '12.5 min' or '5.6 h'."""
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"
