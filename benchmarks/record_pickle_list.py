"""The sharding guide's file as it is: a ~2 GB pickled list of dataclass traces, class not importable, sharded.

    python benchmarks/record_pickle_list.py              # 2 GB (writes ~4 GB under a temporary folder, then deletes it)
    python benchmarks/record_pickle_list.py --gb 0.1     # a quick look

1. A child with torch writes one `pickle.dump(list_of_traces)` (protocol 4): `Trace` is a dataclass of a
   module that only the writer can import, with `hidden_states` [T, 1024] float16 and
   `target_routing` [T, 4] int64 torch tensors and a `layer_id` int (8 layers, T in 64..192): the
   records of `tests/record_traces.trace_records(top_k=4)`.
2. Another child runs exactly `python -m nblib cache --records FILE --out DIR --shard-size-mb 256
   --group-by layer_id` (no other flag), with a path where that module is not importable (it
   checks). It prints its own peak RSS: `ru_maxrss` (getrusage of itself, which also holds the
   pre-exec RSS of this small parent) and VmHWM (the kernel's high-water mark since exec).
3. Every record is read back from the shards and compared bit for bit with the records regenerated
   from their seed (dtype, shape, bytes, layer id, count). The done-when bound: peak RSS <= 1.2 GB.
Results go to benchmarks/results/record_pickle_list.json.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIZES = {"hidden": 1024, "experts": 16, "layers": 8, "tokens": (64, 192), "top_k": 4}
BOUND = 1.2e9
TYPES = ("import dataclasses\n\n\n@dataclasses.dataclass\nclass Trace:\n    hidden_states: object\n"
         "    target_routing: object\n    layer_id: int\n")
WRITER = """
import pickle, sys, torch
from collector_traces import Trace
from tests.record_traces import trace_record_bytes, trace_records
sizes = eval(sys.argv[3])
n = int(float(sys.argv[2]) * 1e9 // (trace_record_bytes(**{k: v for k, v in sizes.items() if k != 'layers'}) + 600))
traces = [Trace(torch.from_numpy(r['hidden_states']), torch.from_numpy(r['target_routing']), r['layer_id'])
          for r in trace_records(n, **sizes)]
with open(sys.argv[1], 'wb') as f:
    pickle.dump(traces, f, protocol=4)
print(n)
"""
CLI = """
import importlib.util, resource, runpy, sys
assert importlib.util.find_spec('collector_traces') is None, 'the class is importable here'
sys.argv = ['nblib', *sys.argv[1:]]
try:
    runpy.run_module('nblib', run_name='__main__')
finally:
    hwm = int(open('/proc/self/status').read().split('VmHWM:')[1].split()[0])
    print('PEAK', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, hwm, file=sys.stderr)
"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gb", type=float, default=2.0, help="size of the pickled list (GB)")
    p.add_argument("--work", default=None, help="scratch folder (default: a temporary one, deleted at the end)")
    p.add_argument("--keep", action="store_true", help="keep the scratch folder")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "record_pickle_list.json"))
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from nblib.cache import RecordShards
    from tests.record_traces import trace_records

    work = Path(args.work or tempfile.mkdtemp(prefix="record-pickle-list-"))
    (work / "types").mkdir(parents=True, exist_ok=True)
    (work / "types" / "collector_traces.py").write_text(TYPES)
    pickled, out = work / "traces.pkl", work / "shards"
    try:
        started = time.perf_counter()
        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{work / 'types'}"}
        written = subprocess.run([sys.executable, "-c", WRITER, str(pickled), str(args.gb), repr(SIZES)], env=env,
                                 capture_output=True, text=True, check=True)
        n_records, size = int(written.stdout), pickled.stat().st_size
        print(f"pickled list: {n_records:,} dataclass traces, {size / 1e9:.3f} GB "
              f"({time.perf_counter() - started:.0f} s)", flush=True)
        command = ["cache", "--records", str(pickled), "--out", str(out), "--shard-size-mb", "256",
                   "--group-by", "layer_id"]
        started = time.perf_counter()
        done = subprocess.run([sys.executable, "-c", CLI, *command], env={**os.environ, "PYTHONPATH": str(ROOT)},
                              capture_output=True, text=True)
        seconds = time.perf_counter() - started
        if done.returncode != 0:
            raise SystemExit(done.stderr[-3000:])
        ru_maxrss_kb, hwm_kb = map(int, done.stderr.split("PEAK")[-1].split())
        print(f"python -m nblib {' '.join(command)}\n  {done.stdout.strip()}\n  {seconds:.0f} s, "
              f"{size / 1e6 / seconds:,.0f} MB/s; peak RSS: ru_maxrss {ru_maxrss_kb / 1e6:.3f} GB, VmHWM "
              f"{hwm_kb / 1e6:.3f} GB (bound {BOUND / 1e9:.1f} GB: "
              f"{'within' if max(ru_maxrss_kb, hwm_kb) * 1e3 <= BOUND else 'OVER'})", flush=True)
        started = time.perf_counter()
        exact, seen = check_bit_exact(RecordShards(out), trace_records)
        print(f"bit-exact: {exact:,} of {n_records:,} records (read {seen:,}; {time.perf_counter() - started:.0f} s)")
        result = {"records": n_records, "pickle_bytes": size, "sizes": {**SIZES, "tokens": list(SIZES["tokens"])},
                  "command": "python -m nblib " + " ".join(command[:1] + ["--records", "FILE", "--out", "DIR"]
                                                           + command[5:]),
                  "seconds": seconds, "ru_maxrss_bytes": ru_maxrss_kb * 1024, "vmhwm_bytes": hwm_kb * 1024,
                  "bound_bytes": BOUND, "within_bound": max(ru_maxrss_kb, hwm_kb) * 1024 <= BOUND,
                  "bit_exact": exact == seen == n_records, "summary": done.stdout.strip(),
                  "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]}}
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")
        return 0 if result["within_bound"] and result["bit_exact"] else 1
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


def check_bit_exact(shards, trace_records) -> tuple[int, int]:
    """(records equal to the regenerated ones, records read): shard by shard, each key's records in input order."""
    layers, exact, seen, nth = SIZES["layers"], 0, 0, {}
    sizes = {k: v for k, v in SIZES.items()}
    for shard, entry in enumerate(shards.shards):
        for local in range(entry["count"]):
            got = shards.record(shard, local)
            key = entry["key"]
            k = nth.get(key, 0)
            nth[key] = k + 1
            want = next(trace_records(1, start=k * layers + key, **sizes))
            seen += 1
            exact += sorted(got) == ["hidden_states", "layer_id", "target_routing"] and got["layer_id"] == key \
                == want["layer_id"] and all(got[f].dtype == want[f].dtype and got[f].shape == want[f].shape
                                            and got[f].tobytes() == want[f].tobytes()
                                            for f in ("hidden_states", "target_routing"))
    return exact, seen


if __name__ == "__main__":
    raise SystemExit(main())
