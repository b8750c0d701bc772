"""A figure's verdict against what was expected: "right" within a relative tolerance, else "wrong".

One definition for every notebook: a value is right when it lies within `tolerance` (default
10%) of the expected value, or of the ends of an expected (low, high) range:
low x (1 - tolerance) <= value <= high x (1 + tolerance). Trade-off: a fixed band says nothing
about noise; repeated measurements and their spread are `nblib.compare`'s job.
"""
from __future__ import annotations

TOLERANCE = 0.10


def within_tolerance(value: float, expected: float | tuple[float, float], tolerance: float = TOLERANCE) -> bool:
    """`value` lies within `tolerance` of `expected` (a value, or a (low, high) range's ends)."""
    low, high = expected if isinstance(expected, tuple) else (expected, expected)
    return low * (1 - tolerance) <= value <= high * (1 + tolerance)


def verdict(right: bool) -> str:
    """The word a table prints for a check: "right" or "wrong"."""
    return "right" if right else "wrong"
