"""One peer's side of benchmarks/record_shards.py, run by the peers' own Python (a separate venv).

    PY record_peers_child.py PEER write STREAM OUT SHARD_MB      # the trace stream into PEER's shards
    PY record_peers_child.py PEER read OUT N SEED                # N uniform random records back

PEER is webdataset (ShardWriter, tars of .npy members), mds (MosaicML streaming's MDSWriter, zstd) or
litdata (LitData's BinaryWriter, zstd). It reads the pickle stream one record at a time (pickle.load
in a loop: the records are ours), and prints one JSON line: seconds, records, and its own peak RSS
(VmHWM). webdataset has no random access: its read mode reports none.
"""
from __future__ import annotations

import json
import pickle
import sys
import time
from pathlib import Path

import numpy as np


def stream(path):
    with open(path, "rb") as f:
        while True:
            try:
                yield pickle.load(f)
            except EOFError:
                return


def write(peer: str, source: str, out: Path, shard_mb: float) -> int:
    n = 0
    if peer == "webdataset":
        import webdataset as wds

        out.mkdir(parents=True, exist_ok=True)
        with wds.ShardWriter(str(out / "shard-%06d.tar"), maxsize=int(shard_mb * 1e6), verbose=0) as sink:
            for n, record in enumerate(stream(source), start=1):
                sink.write({"__key__": f"{n:09d}", **{f"{k}.npy" if isinstance(v, np.ndarray) else f"{k}.cls": v
                                                     for k, v in record.items()}})
    elif peer == "mds":
        from streaming import MDSWriter

        columns = {"hidden_states": "ndarray", "target_routing": "ndarray", "token_ids": "ndarray",
                   "layer_id": "int", "step": "int"}
        with MDSWriter(out=str(out), columns=columns, size_limit=int(shard_mb * 1e6), compression="zstd") as sink:
            for record in stream(source):
                sink.write(record)
                n += 1
    elif peer == "litdata":
        from litdata.streaming.writer import BinaryWriter

        sink = BinaryWriter(str(out), chunk_bytes=int(shard_mb * 1e6), compression="zstd")
        for n, record in enumerate(stream(source), start=1):
            sink.add_item(n - 1, record)
        sink.done()
        sink.merge()
    else:
        raise SystemExit(f"unknown peer {peer}")
    return n


def read(peer: str, out: Path, n: int, seed: int) -> tuple[int, float]:
    if peer == "webdataset":
        return 0, 0.0
    if peer == "mds":
        from streaming import StreamingDataset

        dataset = StreamingDataset(local=str(out), shuffle=False, batch_size=1)
    else:
        from litdata import StreamingDataset

        dataset = StreamingDataset(str(out))
    picks = np.random.default_rng(seed).integers(0, len(dataset), n)
    dataset[int(picks[0])]  # opens the first shard: not timed, as for ours (a warm-up round)
    started = time.perf_counter()
    for i in picks:
        assert dataset[int(i)]["hidden_states"].size
    return n, time.perf_counter() - started


def main() -> None:
    peer, mode = sys.argv[1], sys.argv[2]
    started = time.perf_counter()
    if mode == "write":
        n, seconds = write(peer, sys.argv[3], Path(sys.argv[4]), float(sys.argv[5])), None
    else:
        n, seconds = read(peer, Path(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
    seconds = time.perf_counter() - started if seconds is None else seconds
    with open("/proc/self/status") as status:
        peak = int(status.read().split("VmHWM:")[1].split()[0]) * 1024
    print(json.dumps({"peer": peer, "mode": mode, "records": n, "seconds": seconds, "peak_rss": peak}))


if __name__ == "__main__":
    main()
