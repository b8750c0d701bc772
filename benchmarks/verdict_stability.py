"""Do the notebooks' verdicts survive load? Notebooks 01, 02 and 05 run twice, once as the machine is and once beside
two CPU hogs, and every verdict they print is paired across the two runs (issue 53).

    .venv/bin/python benchmarks/verdict_stability.py [--notebooks 01 02 05] [--hogs 2] [--max-moves 2]

Each notebook is executed by `nblib.suite.run_notebook` (nbclient, its own kernel, cwd notebooks/), the way
`make run` executes it: NBLIB_PROFILE=smoke and the kernel's threads pinned as `make test` pins them
(OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 TORCHINDUCTOR_COMPILE_THREADS=1, `nblib.suite.KERNEL_THREADS`). The loaded run
has `--hogs` processes of `python -c 'while 1: pass'` beside it, started before the kernel and killed after it.
The two conditions alternate per notebook (plain first for the 1st and 3rd notebook, loaded first for the 2nd), so
neither always meets a warm cache. The executed copies go to OUT/plain and OUT/loaded.

The verdicts are read and paired by scripts/verdict_diff.py (the one reader): a move is a verdict firm in one run and
"not distinguishable"/"cannot tell" in the other, a reversal one firm both times in opposite directions. The load
average (os.getloadavg) is printed beside every run: on a machine that other work already keeps busy, the "plain"
run is not quiet, and the table says by how much. Exit status 1 on a reversal or more moves than --max-moves.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
HOG = "while 1: pass"


def verdict_diff():
    """scripts/verdict_diff.py as a module: the one reader of a notebook's printed verdicts."""
    spec = importlib.util.spec_from_file_location("verdict_diff", ROOT / "scripts" / "verdict_diff.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["verdict_diff"] = module
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def cpu_hogs(n: int):
    """`n` busy Python processes for the duration of the block, killed (and reaped) after it, whatever happens."""
    hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(n)]
    try:
        yield hogs
    finally:
        for hog in hogs:
            hog.kill()
        for hog in hogs:
            hog.wait()


def load() -> str:
    """The 1-minute load average and the cores it is shared by: '7.9 on 2 cores'."""
    return f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"


def execute(path: Path, out: Path, hogs: int) -> dict:
    """Run one notebook beside `hogs` CPU hogs (0: as the machine is); its status, seconds and the load around it."""
    from nblib.suite import run_notebook

    before = load()
    with cpu_hogs(hogs):
        time.sleep(2 if hogs else 0)          # the hogs are running before the kernel starts
        result = run_notebook(path, out)
        during = load()
    return {"notebook": path.name, "hogs": hogs, "status": result.status, "seconds": result.seconds,
            "error": result.error, "load before": before, "load at the end": during}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--notebooks", nargs="+", default=["01", "02", "05"], help="notebook numbers, in order")
    parser.add_argument("--hogs", type=int, default=2, help="CPU hogs beside the loaded run (default 2)")
    parser.add_argument("--max-moves", type=int, default=2, help="moves allowed in total (default 2)")
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "verdict_stability")
    args = parser.parse_args(argv)
    os.environ["NBLIB_PROFILE"] = "smoke"
    from nblib.suite import KERNEL_THREADS

    os.environ.update(KERNEL_THREADS)         # pinned as `make test` pins them, whatever this shell set
    paths = [next(NOTEBOOKS.glob(f"{n}_*.ipynb")) for n in args.notebooks]
    plain, loaded = args.out / "plain", args.out / "loaded"
    print(f"verdict stability: {', '.join(p.name for p in paths)}; smoke profile; "
          + " ".join(f"{k}={v}" for k, v in KERNEL_THREADS.items()) + f"; loaded runs beside {args.hogs} CPU hogs; "
          f"load now {load()}", flush=True)
    runs = []
    for i, path in enumerate(paths):
        order = [(plain, 0), (loaded, args.hogs)]
        for out, hogs in (order if i % 2 == 0 else order[::-1]):
            runs.append(execute(path, out, hogs))
            r = runs[-1]
            print(f"  {r['notebook']:<36} {'loaded' if hogs else 'plain':<7} {r['status']:<7} {r['seconds']:7.1f} s  "
                  f"load {r['load before']} before, {r['load at the end']} at the end {r['error']}", flush=True)
    vd = verdict_diff()
    pairs = []
    for path in paths:
        pairs += vd.compare_runs(vd.extract(plain / path.name), vd.extract(loaded / path.name))
    for v, w, state in pairs:
        where = v or w
        print(f"{state:<16} {where.notebook} cell {where.cell}: {where.label}\n"
              f"{'':<16}   plain:  {vd._call(v)}\n{'':<16}   loaded: {vd._call(w)}")
    total = vd.summary(pairs)
    failed = [r["notebook"] + (" (loaded)" if r["hogs"] else " (plain)") for r in runs if r["status"] != "ok"]
    print("summary: " + ", ".join(f"{k} {n}" for k, n in total.items()) + f" (moves allowed: {args.max_moves})"
          + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return int(bool(failed) or total["reversals"] > 0 or total["moves"] > args.max_moves)


if __name__ == "__main__":
    sys.exit(main())
