"""Record shards at the guide's scale: peak RSS of sharding a 1 GB trace, bytes per record, read rates vs Parquet.

    python benchmarks/record_shards.py                       # 1 GB guide-like pickle stream, 400 and 64 MB shards
    python benchmarks/record_shards.py --gb 0.1 --rounds 2   # a quick look

1. Writes a guide-like MoE trace (`tests/record_traces.py`: hidden_states [T, 1024] fp16,
   target_routing [T, 16] fp32, token_ids, layer_id of 8 layers, T in 64..192) as a pickle stream.
2. Shards it with the real command, `nblib cache --records FILE --out DIR --shard-size-mb S
   --group-by layer_id` (nblib.cli.main in a child process), whose peak RSS is the kernel's
   high-water mark (VmHWM), against the same command on a 10-record file (the process's fixed cost);
   the done-when bound is peak < 1.5 x S + fixed.
3. Bytes per record: the pickle, the record shards (zstd 3), and Parquet (pyarrow, zstd 3, arrays as
   binary columns with their token count, row groups of ~32 MB).
4. Read rates, warm page cache, one core (pyarrow set to one CPU and one IO thread), a warm-up
   round not counted, then rounds interleaved (ours, Parquet, ours, ...), medians and
   spreads: in order (every record decoded to numpy arrays), a shard-window shuffle (ours: window of
   one shard; Parquet: row groups in a shuffled order, rows shuffled within), and uniform random
   records (ours: any shard; Parquet: the row group holding the row, the last one kept).
5. Peak RSS of a child reading every record in shuffled order (ours), against its fixed cost.
6. With `--peers PYTHON` (a separate venv holding webdataset, mosaicml-streaming and litdata, never
   the project's): the peers' table. Each peer writes the same stream at the smallest shard size
   (`benchmarks/record_peers_child.py`, a child of that Python: wall time from here, its own VmHWM),
   then reads --random-reads uniform random records (webdataset has no random access), beside ours.
Results go to benchmarks/results/record_shards.json.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SIZES = {"hidden": 1024, "experts": 16, "layers": 8, "tokens": (64, 192)}
ROW_GROUP_BYTES = 32e6


HWM = ("; print('VmHWM', open('/proc/self/status').read().split('VmHWM:')[1].split()[0], file=sys.stderr)")
CLI_CHILD = "import sys; from nblib.cli import main; rc = main(sys.argv[1:])" + HWM + "; sys.exit(rc)"


def run_child(args: list[str]) -> tuple[int, float, str]:
    """(peak RSS bytes, seconds, stdout) of `python -c CODE ARGS` whose code prints its VmHWM last.

    VmHWM (/proc/self/status) is the kernel's high-water mark of the process's own memory since
    its exec; os.wait4's ru_maxrss is not: it also holds the RSS of the parent it was forked from.
    """
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    started = time.perf_counter()
    done = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    peak_kb = int(done.stderr.strip().splitlines()[-1].split()[1])
    return peak_kb * 1024, seconds, done.stdout


def shard_command(source: Path, out: Path, shard_mb: float) -> list[str]:
    shutil.rmtree(out, ignore_errors=True)  # a fresh build each time (a folder there would be resumed)
    return ["-c", CLI_CHILD, "cache", "--records", str(source), "--out", str(out), "--shard-size-mb", str(shard_mb),
            "--group-by", "layer_id"]


def write_parquet(shards, path: Path) -> None:
    """The same records, in the same order, as Parquet: arrays as binary cells, T beside them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows_per_group = max(1, int(ROW_GROUP_BYTES // (shards.manifest["shards"][0]["raw_bytes"]
                                                    / shards.manifest["shards"][0]["count"])))
    writer, batch = None, []

    def flush():
        nonlocal writer
        table = pa.table({
            "n_tokens": pa.array([r["hidden_states"].shape[0] for r in batch], pa.int32()),
            "hidden_states": pa.array([r["hidden_states"].tobytes() for r in batch], pa.binary()),
            "target_routing": pa.array([r["target_routing"].tobytes() for r in batch], pa.binary()),
            "token_ids": pa.array([r["token_ids"].tobytes() for r in batch], pa.binary()),
            "layer_id": pa.array([r["layer_id"] for r in batch], pa.int32()),
            "step": pa.array([r["step"] for r in batch], pa.int64())})
        writer = writer or pq.ParquetWriter(path, table.schema, compression="zstd", compression_level=3)
        writer.write_table(table, row_group_size=len(batch))

    for record in shards.iter_records():
        batch.append(record)
        if len(batch) == rows_per_group:
            flush()
            batch = []
    if batch:
        flush()
    writer.close()


class ParquetBatch:
    """A row group or record batch as numpy views of its columns: a row becomes a record without per-cell objects."""

    def __init__(self, table):
        self.rows = table.num_rows
        self.n_tokens = table.column("n_tokens").to_numpy()
        self.layer_id = table.column("layer_id").to_numpy()
        self.step = table.column("step").to_numpy()
        self.binary = {name: _binary_views(table.column(name)) for name in ("hidden_states", "target_routing",
                                                                            "token_ids")}

    def record(self, row: int) -> dict:
        t = int(self.n_tokens[row])

        def cell(name, dtype):
            offsets, data = self.binary[name]
            return data[offsets[row]:offsets[row + 1]].view(dtype).copy()  # a copy, as our reader serves

        return {"hidden_states": cell("hidden_states", np.float16).reshape(t, SIZES["hidden"]),
                "target_routing": cell("target_routing", np.float32).reshape(t, SIZES["experts"]),
                "token_ids": cell("token_ids", np.int32), "layer_id": int(self.layer_id[row]),
                "step": int(self.step[row])}


def _binary_views(column):
    """(offsets, bytes) of a binary column as numpy arrays over Arrow's own buffers (one chunk)."""
    chunk = column.combine_chunks() if hasattr(column, "combine_chunks") else column
    _validity, offsets, data = chunk.buffers()
    start = chunk.offset
    offsets = np.frombuffer(offsets, dtype=np.int32)[start:start + len(chunk) + 1]
    return offsets, np.frombuffer(data, dtype=np.uint8)


class ParquetRecords:
    """Parquet read by pyarrow as a record source: row -> record, keeping the last row group read."""

    def __init__(self, path: Path):
        import pyarrow as pa
        import pyarrow.parquet as pq

        pa.set_cpu_count(1)  # one core, as our reader uses: like for like
        pa.set_io_thread_count(1)
        self.file = pq.ParquetFile(path)
        counts = [self.file.metadata.row_group(g).num_rows for g in range(self.file.num_row_groups)]
        self.starts = np.concatenate([[0], np.cumsum(counts)])
        self._group = (None, None)

    def __len__(self):
        return int(self.starts[-1])

    def group(self, g: int) -> ParquetBatch:
        if self._group[0] != g:
            self._group = (g, ParquetBatch(self.file.read_row_group(g)))
        return self._group[1]

    def __getitem__(self, index: int) -> dict:
        g = int(np.searchsorted(self.starts, index, side="right")) - 1
        return self.group(g).record(index - int(self.starts[g]))

    def in_order(self):
        for batch in self.file.iter_batches(batch_size=256):
            columns = ParquetBatch(batch)
            for row in range(columns.rows):
                yield columns.record(row)

    def windowed(self, seed: int):
        rng = np.random.default_rng(seed)
        for g in rng.permutation(self.file.num_row_groups):
            group = self.group(int(g))
            for row in rng.permutation(group.rows):
                yield group.record(int(row))


def timed(records) -> tuple[float, int]:
    """(records/s, bytes touched) of consuming an iterator of records."""
    started, n, nbytes = time.perf_counter(), 0, 0
    for record in records:
        n += 1
        nbytes += record["hidden_states"].nbytes
    return n / (time.perf_counter() - started), nbytes


def read_rates(shards, parquet: ParquetRecords, rounds: int, random_reads: int) -> dict:
    """Interleaved rounds of in-order, shard-window and uniform-random reads; medians and spreads."""
    rates: dict[str, list[float]] = {}
    n = len(shards)
    for k in range(-1, rounds):  # round -1 warms imports and the page cache: not counted
        seed = k + 1
        picks = np.random.default_rng(seed).integers(0, n, random_reads)
        for name, records in (("nblib in order", shards.iter_records()),
                              ("parquet in order", parquet.in_order()),
                              ("nblib shard-window shuffle", shards.iter_records(shards.shuffle(seed=seed))),
                              ("parquet row-group shuffle", parquet.windowed(seed)),
                              ("nblib uniform random", (shards[int(i)] for i in picks)),
                              ("parquet uniform random", (parquet[int(i)] for i in picks))):
            rate = timed(records)[0]  # generators: nothing runs before its turn
            if k >= 0:
                rates.setdefault(name, []).append(rate)
    return {name: {"median_records_per_s": statistics.median(v), "min": min(v), "max": max(v), "rounds": v}
            for name, v in rates.items()}


READ_CHILD = ("import sys; from nblib.cache import RecordShards; r = RecordShards(sys.argv[1]); "
              "n = sum(1 for x in r.iter_records(r.shuffle(seed=1))) if sys.argv[2] == 'read' else 0" + HWM)


PEERS = ("webdataset", "mds", "litdata")


def peers_table(args, result: dict, stream: Path, work: Path) -> list[dict]:
    """Write time, peak RSS and random reads of the peers beside ours, on the same stream and shard size."""
    shard_mb = min(args.shard_mb)
    ours = next(row for row in result["sharding"] if row["shard_mb"] == shard_mb)
    rows = [{"system": "nblib record shards", "write_s": ours["seconds"], "peak_rss": ours["peak_rss"],
             "random_records_per_s": result["reads"]["nblib uniform random"]["median_records_per_s"]}]
    child = str(ROOT / "benchmarks" / "record_peers_child.py")
    for peer in PEERS:
        out = work / f"peer-{peer}"
        shutil.rmtree(out, ignore_errors=True)
        row = {"system": peer}
        try:
            started = time.perf_counter()
            command = [args.peers, child, peer, "write", str(stream), str(out), str(shard_mb)]
            written = json.loads(subprocess.run(command, capture_output=True, text=True,
                                                check=True).stdout.splitlines()[-1])
            row.update(write_s=time.perf_counter() - started, peak_rss=written["peak_rss"])
            read = json.loads(subprocess.run([args.peers, child, peer, "read", str(out), str(args.random_reads), "1"],
                                             capture_output=True, text=True, check=True).stdout.splitlines()[-1])
            row["random_records_per_s"] = read["records"] / read["seconds"] if read["records"] else None
        except (subprocess.CalledProcessError, ValueError, IndexError) as exc:
            row["error"] = (getattr(exc, "stderr", "") or str(exc)).strip().splitlines()[-1:]
        rows.append(row)
    print(f"peers at --shard-size-mb {shard_mb:g} (write: wall time of the command; peak: its VmHWM):")
    for row in rows:
        rate = row.get("random_records_per_s")
        print(f"  {row['system']:22s} " + (f"error {row['error']}" if "error" in row else
              f"write {row['write_s']:6.1f} s  peak RSS {row['peak_rss'] / 1e6:7,.0f} MB  random reads "
              + (f"{rate:8,.0f} records/s" if rate else "    none (no random access)")))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gb", type=float, default=1.0, help="size of the pickle stream (GB)")
    p.add_argument("--shard-mb", type=float, nargs="+", default=[400, 64])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--random-reads", type=int, default=1500)
    p.add_argument("--work", default=None, help="scratch folder (default: a temporary one)")
    p.add_argument("--reuse", action="store_true", help="keep a trace.pkl already in --work (same --gb)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "record_shards.json"))
    p.add_argument("--peers", default=None, help="a Python with webdataset, mosaicml-streaming and litdata "
                                                 "(e.g. /tmp/peers-venv/bin/python): add the peers' table")
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from nblib.cache import RecordShards, record_source
    from tests.record_traces import write_trace_pickle

    work = Path(args.work or tempfile.mkdtemp(prefix="record-shards-"))
    work.mkdir(parents=True, exist_ok=True)
    stream, tiny = work / "trace.pkl", work / "tiny.pkl"
    started = time.perf_counter()
    if args.reuse and stream.exists():
        n_records = sum(1 for _ in record_source(stream))
    else:
        n_records = write_trace_pickle(stream, target_bytes=int(args.gb * 1e9), **SIZES)
    write_trace_pickle(tiny, n_records=10, **SIZES)
    print(f"trace: {n_records:,} records, {stream.stat().st_size / 1e9:.3f} GB pickle stream "
          f"({time.perf_counter() - started:.0f} s to write)", flush=True)
    result = {"trace": {"records": n_records, "pickle_bytes": stream.stat().st_size, "sizes": SIZES},
              "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]}, "sharding": []}
    for shard_mb in args.shard_mb:
        fixed, _s, _o = run_child(shard_command(tiny, work / "tiny-out", shard_mb))
        peak, seconds, out = run_child(shard_command(stream, work / f"shards-{shard_mb:g}", shard_mb))
        bound = 1.5 * shard_mb * 1e6 + fixed
        row = {"shard_mb": shard_mb, "peak_rss": peak, "fixed_rss": fixed, "bound": bound, "seconds": seconds,
               "within_bound": peak < bound, "summary": out.strip()}
        result["sharding"].append(row)
        print(f"--shard-size-mb {shard_mb:g} --group-by layer_id: peak RSS {peak / 1e6:,.0f} MB (fixed cost "
              f"{fixed / 1e6:,.0f} MB; bound 1.5 x shard + fixed = {bound / 1e6:,.0f} MB: "
              f"{'within' if peak < bound else 'OVER'}), {seconds:.0f} s, "
              f"{stream.stat().st_size / 1e6 / seconds:,.0f} MB/s\n  {out.strip()}", flush=True)
    folder = work / f"shards-{min(args.shard_mb):g}"
    shards = RecordShards(folder)
    parquet_path = work / "trace.parquet"
    write_parquet(shards, parquet_path)
    stored = sum(s["bytes"] for s in shards.manifest["shards"])
    result["bytes_per_record"] = {"pickle": stream.stat().st_size / n_records,
                                  "record_shards_zstd3": stored / n_records,
                                  "raw_payload": sum(s["raw_bytes"] for s in shards.manifest["shards"]) / n_records,
                                  "parquet_zstd3": parquet_path.stat().st_size / n_records}
    print("bytes per record: " + ", ".join(f"{k} {v:,.0f}" for k, v in result["bytes_per_record"].items()), flush=True)
    result["reads"] = read_rates(shards, ParquetRecords(parquet_path), args.rounds, args.random_reads)
    for name, row in result["reads"].items():
        print(f"  {name:30s} {row['median_records_per_s']:10,.0f} records/s  (min {row['min']:,.0f}, "
              f"max {row['max']:,.0f})")
    read_fixed, _s, _o = run_child(["-c", READ_CHILD, str(folder), "idle"])
    read_peak, _s, _o = run_child(["-c", READ_CHILD, str(folder), "read"])
    largest = max(s["bytes"] for s in shards.manifest["shards"])
    result["read_peak_rss"] = {"peak": read_peak, "fixed": read_fixed, "largest_shard_bytes": largest,
                               "folder_bytes": stored}
    print(f"reading every record, shuffled: peak RSS {read_peak / 1e6:,.0f} MB, fixed {read_fixed / 1e6:,.0f} MB, "
          f"largest shard {largest / 1e6:,.0f} MB, folder {stored / 1e6:,.0f} MB")
    if args.peers:
        result["peers"] = peers_table(args, result, stream, work)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
