"""Units: byte, rate and duration constants and formatters (decimal units, as disks are sold), and an
exception's first line, clipped, for one-line reports.
"""
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


def fmt_size(n: float) -> str:
    """A refusal's figure: GB with two decimals from 0.1 GB up, else in the unit that shows it (a small
    disk's shortfall reads '1.92 MB', never '0.00 GB').
    """
    return f"{n / GB:,.2f} GB" if abs(n) >= 0.1 * GB else fmt_bytes(n)


def fmt_gb(n: float | None, digits: int = 1) -> str:
    """`n` bytes in GB with `digits` decimals; '-' for None."""
    return "-" if n is None else f"{n / GB:.{digits}f} GB"


def fmt_rate(per_second: float, unit: str = "samples") -> str:
    """A rate such as '345.2 samples/s', '1,234 samples/s', or '0.234 samples/s' (a slow rate keeps three
    significant digits: never '0 samples/s').
    """
    if 0 < abs(per_second) < 1:
        return f"{per_second:.3g} {unit}/s"
    return f"{per_second:,.1f} {unit}/s" if per_second < 1000 else f"{per_second:,.0f} {unit}/s"


_DURATION_UNITS = (("h", 3600.0, 3600.0), ("min", 60.0, 120.0), ("s", 1.0, 1.0), ("ms", 1e-3, 1e-3),
                   ("µs", 1e-6, 0.0))


def _duration_unit(seconds: float) -> tuple[str, float]:
    """The unit a duration reads in: h from one hour, min from two minutes, s from one second, ms from one
    millisecond, else µs ('7.96 µs', never '0.00796 ms').
    """
    return next(((name, size) for name, size, floor in _DURATION_UNITS if abs(seconds) >= floor), ("µs", 1e-6))


def _duration_number(seconds: float, unit: str, size: float) -> str:
    value = seconds / size
    if unit == "h":
        return f"{value:,.2f}"
    small = unit in ("ms", "µs")
    return f"{value:.3g}" if small and abs(value) < 100 else f"{value:,.{0 if small else 1}f}"


def fmt_duration(seconds: float) -> str:
    """Seconds as '850 ms', '42.0 s', '12.5 min' or '5.63 h' (a short time keeps its digits: never '0.0 s')."""
    unit, size = _duration_unit(seconds)
    return f"{_duration_number(seconds, unit, size)} {unit}"


def fmt_duration_range(low: float, mid: float, high: float) -> str:
    """A duration and its range, in seconds, in the unit `fmt_duration` picks for the mid: '1.76 h (1.46-2.13 h)',
    '7.2 s (6.0-8.7 s)' (a small run is never '0.00 h').
    """
    unit, size = _duration_unit(mid)
    low_text, mid_text, high_text = (_duration_number(v, unit, size) for v in (low, mid, high))
    return f"{mid_text} {unit} ({low_text}-{high_text} {unit})"


def fmt_repr(value, limit: int = 60) -> str:
    """`repr(value)`, clipped to `limit` characters with "..." (a value quoted in an error message)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def fmt_exception(exc: BaseException, limit: int = 300, *, with_type: bool = False) -> str:
    """The first non-empty line of `exc`'s message, clipped to `limit` characters (its type's name if empty).

    with_type: prefix the type's name ("OSError: ..."), clipped together.
    """
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    first = lines[0] if lines else ("" if with_type else type(exc).__name__)
    return (f"{type(exc).__name__}: {first}" if with_type else first)[:limit]
