"""RAM for one large record is what the docs say: 2x its bytes to shard it raw (the record and its payload), 3x
with zstd (its compressed copy too), and its bytes once to read it back (docs/formats.md, nblib/cache/records.py).

Measured with tracemalloc (numpy and bytes allocations are traced) in a fresh process, on a 200 MB record of
incompressible bytes read from a pickle: the red team's 2.2 GB record peaked at 6.49 GB to build and 4.34 GB to
read (3x and 2x), where the docs said "RAM holds one record".
"""
from __future__ import annotations

import pickle
import subprocess
import sys

import numpy as np
import pytest

from conftest import subprocess_env

SIZE = 200_000_000
MEASURE = """
import sys, tracemalloc
from nblib.cache import RecordShards, record_source, write_records
tracemalloc.start()
write_records(record_source(sys.argv[1]), sys.argv[2], codec=sys.argv[3])
build = tracemalloc.get_traced_memory()[1]
tracemalloc.reset_peak()
record = RecordShards(sys.argv[2])[0]
print(build, tracemalloc.get_traced_memory()[1], record["x"].nbytes)
"""


@pytest.mark.parametrize("codec, build_factor", [("raw", 2), ("zstd", 3)])
def test_a_large_record_is_sharded_and_read_in_the_ram_the_docs_state(tmp_path, codec, build_factor):
    path = tmp_path / "big.pkl"
    with open(path, "wb") as f:
        pickle.dump({"x": np.random.default_rng(0).integers(0, 255, SIZE, dtype=np.uint8), "i": 1}, f, protocol=4)
    done = subprocess.run([sys.executable, "-c", MEASURE, str(path), str(tmp_path / codec), codec],
                          env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    build, read, nbytes = map(int, done.stdout.split())
    assert nbytes == SIZE
    assert build < (build_factor + 0.1) * SIZE, (build / SIZE, codec)
    assert read < 1.1 * SIZE, (read / SIZE, codec)
