"""Counts of the records reader against the standard library's unpickler, over generated pickles (issue 48).

    python benchmarks/pickle_differential_counts.py [--examples 1000]

The generator and the oracle are tests/test_pickle_differential.py's (top objects people dump, protocols 0-5,
separate dumps and one-Pickler streams; the oracle is `pickle.Unpickler` with the documented shape rules). Each
generated file is read by both readers (NBLIB_PICKLE_READER=pure, =fast) and counted: bit-exact (every record equal
in value, type and bits), refused (one line; a one-Pickler stream whose memo only an earlier dump wrote may be), or
different. The tests assert; this prints how many of each.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "tests"), str(Path(__file__).resolve().parents[1])]

import pickle  # noqa: E402

import nblib.cache.pickle_fast as pickle_fast  # noqa: E402
from nblib.cache.pickle_stream import pickle_records  # noqa: E402
from nblib.errors import InputError  # noqa: E402
from tests.test_pickle_differential import _readings, _same_records, _write, tops  # noqa: E402

STREAM_REFUSED = "refused (one line) of a one-Pickler stream"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--examples", type=int, default=1000)
    args = p.parse_args()
    counts = {reader: Counter() for reader in ("pure", "fast")}
    folder = Path(tempfile.mkdtemp())

    @settings(max_examples=args.examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(objects=st.lists(tops(), min_size=1, max_size=2), protocol=st.integers(0, pickle.HIGHEST_PROTOCOL),
           one_pickler=st.booleans())
    def count(objects, protocol, one_pickler):
        data = _write(objects, protocol, one_pickler)
        path = folder / "f.pkl"
        path.write_bytes(data)
        fresh, carried = _readings(data, len(objects) == 1)
        for reader in counts:
            os.environ[pickle_fast.READER_ENV] = reader
            try:
                got = list(pickle_records(path))
            except InputError:
                counts[reader][STREAM_REFUSED if one_pickler else "refused (one line)"] += 1
                continue
            same = _same_records(fresh, got) or (one_pickler and _same_records(carried, got))
            counts[reader]["bit-exact" if same else "different"] += 1

    count()
    for reader, counted in counts.items():
        total = sum(counted.values())
        print(f"{reader:5s} reader: {total:,} generated files: " + ", ".join(
            f"{counted[k]:,} {k}" for k in ("bit-exact", STREAM_REFUSED, "refused (one line)", "different")))


if __name__ == "__main__":
    main()
