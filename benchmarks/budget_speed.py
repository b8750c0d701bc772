"""How long `budget --model` of ViT-B/16 (hf:ViTModel, 224 px) takes, encode and train, fp16, largest-batch search on.

    .venv/bin/python benchmarks/budget_speed.py [--json benchmarks/results/budget_speed.json]

Each timed run is `python -m nblib budget --model hf:ViTModel --device t4 --precision fp16 [--train]` in a fresh
process from a snapshot of this checkout's committed nblib (`git archive HEAD nblib`: a kept trace is keyed by
nblib's code, which other work in this checkout edits meanwhile), as a user starts it, with a user's environment
(no NBLIB_/PYTORCH_ variables, one thread per library as `make test` runs). Three states of the per-user folder
(XDG_CACHE_HOME, a new one each):
- cold: empty (no compiled fake-CUDA shim, no kept trace): a user's first budget on this machine and torch;
- cold trace: the shim compiled (timed apart: `shim compile`), no trace kept: a first budget of this model;
- warm: the same command again in that folder (the trace and the largest batch's search kept there by the first:
  nblib.budget.model_vram.kept_trace, no child).
Issue 49's targets: warm <= 5 s, cold <= 30 s on a quiet machine. This machine is shared: the load average (1 min)
is printed before and after every run, and the verdict says when the load makes a run not "quiet".
Where the time goes: the parent's parts from cProfile over `nblib.cli.main` in a fresh process, a first (cold trace)
and a second (warm) run in one folder (nblib's imports before it, the shim's compile, the kept trace's read, the
wait for the traced child, the search's replays, the replay of the asked batch), and the child's parts timed apart
in fresh processes (import torch, import transformers, build the ViT with random weights); the trace itself
is the child's wall less those.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CWD = REPO                          # where the timed processes run: a snapshot of nblib (main)
MODEL = "hf:ViTModel"               # ViT-B/16 at 224 px: transformers' default ViTConfig (docs/your-model.md)
JOBS = {"encode": [], "train": ["--train"]}
WARM_TARGET_S, COLD_TARGET_S = 5.0, 30.0
QUIET_LOAD = 1.0                    # a 1-minute load average above this on 2 cores is not a quiet machine
# the parent's functions whose cumulative time is a part of the breakdown (the first of each name found)
PARENT_PARTS = {"shim_path": "shim compile (or find)", "find_result": "kept trace read (user's folder)",
                "run_child": "traced child (wall, in the parent)", "save_result": "kept trace written",
                "largest_batch": "largest-batch search (replays)", "replayed_point": "replays (search and batch)",
                "table": "the printed table"}
CHILD_PARTS = """
import json, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
import transformers.modeling_utils
t2 = time.perf_counter()
from nblib.models import load_model
load_model({model!r})
t3 = time.perf_counter()
print(json.dumps({{"import torch": t1 - t0, "import transformers": t2 - t1, "build the model": t3 - t2}}))
"""
PROFILED = """
import cProfile, json, pstats, sys, time
t0 = time.perf_counter()
from nblib.cli import main
import nblib.cli.budget, nblib.budget.model_vram
imports = time.perf_counter() - t0
profile = cProfile.Profile()
profile.enable()
code = main({argv!r})
profile.disable()
stats = pstats.Stats(profile).stats
parts = {{}}
for (path, line, name), (cc, nc, tt, ct, callers) in stats.items():
    if name in {names!r} and "nblib" in path and name not in parts:
        parts[name] = ct
print(json.dumps({{"nblib imports": imports, "main": sum(v[2] for v in stats.values()), "parts": parts,
                  "code": code}}))
"""


def user_env(cache_home: str) -> dict:
    """A user's environment: this one less NBLIB_/PYTORCH_ variables, the per-user folder named, one thread."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NBLIB_", "PYTORCH_"))}
    env.update(XDG_CACHE_HOME=cache_home, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return env


def load() -> float:
    return os.getloadavg()[0]


def timed(command: list[str], cache_home: str) -> dict:
    """One fresh process in the snapshot (`CWD`): its seconds, its stdout, and the load before and after."""
    before = load()
    start = time.perf_counter()
    done = subprocess.run(command, cwd=CWD, env=user_env(cache_home), capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} exited {done.returncode}: {(done.stdout + done.stderr)[-2000:]}")
    return {"seconds": seconds, "load_before": before, "load_after": load(), "stdout": done.stdout}


def cli(job: str) -> list[str]:
    return [sys.executable, "-m", "nblib", "budget", "--model", MODEL, "--device", "t4", "--precision", "fp16",
            *JOBS[job]]


def show(label: str, run: dict) -> None:
    print(f"  {label:<12}{run['seconds']:7.1f} s   load {run['load_before']:.1f} -> {run['load_after']:.1f}",
          flush=True)


def measure(job: str, root: Path) -> dict:
    """cold, shim compile, cold trace and warm for one job, each in a new per-user folder where it says so."""
    print(f"budget --model {MODEL} --precision fp16 {' '.join(JOBS[job])} ({job}):", flush=True)
    cold_home, trace_home = str(root / f"{job}-cold"), str(root / f"{job}-trace")
    out = {"cold": timed(cli(job), cold_home)}
    show("cold", out["cold"])
    out["shim compile"] = timed([sys.executable, "-c", "from nblib.budget.shim import shim_path; shim_path()"],
                                trace_home)
    show("shim compile", out["shim compile"])
    out["cold trace"] = timed(cli(job), trace_home)
    show("cold trace", out["cold trace"])
    out["warm"] = timed(cli(job), trace_home)
    show("warm", out["warm"])
    answers = {out[k]["stdout"] for k in ("cold", "cold trace", "warm")}
    if len(answers) != 1:
        raise SystemExit(f"{job}: the cold and warm runs printed different budgets")
    print("  " + next(line for line in out["warm"]["stdout"].splitlines() if "largest batch" in line).strip())
    return out


def breakdown(job: str, root: Path) -> dict:
    """The parent's parts (cProfile, a fresh process, the shim already compiled) and the child's, timed apart."""
    home = str(root / f"{job}-profile")
    timed([sys.executable, "-c", "from nblib.budget.shim import shim_path; shim_path()"], home)
    argv = ["budget", "--model", MODEL, "--device", "t4", "--precision", "fp16", *JOBS[job]]
    profiled = [sys.executable, "-c", PROFILED.format(argv=argv, names=set(PARENT_PARTS))]
    parent = json.loads(timed(profiled, home)["stdout"].splitlines()[-1])
    warm = json.loads(timed(profiled, home)["stdout"].splitlines()[-1])
    child = json.loads(timed([sys.executable, "-c", CHILD_PARTS.format(model=MODEL)], home)["stdout"].splitlines()[-1])
    waited = parent["parts"].get("run_child")
    if waited is not None:
        child["trace (the child's wall less the above)"] = waited - sum(child.values())
    print(f"  where the time goes ({job}, shim compiled, load {load():.1f}): cold trace | warm")
    print(f"    {'nblib imports (parent)':<44}{parent['nblib imports']:6.1f} s | {warm['nblib imports']:6.1f} s")
    print(f"    {'main (all of the budget)':<44}{parent['main']:6.1f} s | {warm['main']:6.1f} s")
    for name, label in PARENT_PARTS.items():
        print(f"    {label:<44}" + " | ".join("     -  " if run["parts"].get(name) is None else
                                            f"{run['parts'][name]:6.1f} s" for run in (parent, warm)))
    for label, value in child.items():
        print(f"      child: {label:<37}{value:6.1f} s")
    return {"parent": parent, "parent warm": warm, "child": child}


def verdict(results: dict) -> list[str]:
    lines = []
    for job, r in results.items():
        quiet = max(r[k]["load_before"] for k in ("cold", "warm")) <= QUIET_LOAD
        for state, target in (("warm", WARM_TARGET_S), ("cold", COLD_TARGET_S)):
            s = r[state]["seconds"]
            lines.append(f"{job} {state}: {s:.1f} s against <= {target:.0f} s: "
                         f"{'met' if s <= target else 'NOT met'}"
                         + ("" if quiet else f" (load {r[state]['load_before']:.1f}: not a quiet machine)"))
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the figures here (benchmarks/results/budget_speed.json)")
    args = parser.parse_args(argv)
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"{uptime}; {os.cpu_count()} cores; {sys.executable}")
    results = {}
    global CWD
    with tempfile.TemporaryDirectory(prefix="nblib-budget-speed-") as tmp:
        CWD = Path(tmp) / "checkout"
        CWD.mkdir()
        archive = subprocess.run(["git", "archive", "HEAD", "nblib"], cwd=REPO, capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(CWD)], input=archive.stdout, check=True)
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                              text=True).stdout.strip()
        found = timed([sys.executable, "-c", "import nblib; print(nblib.__file__)"], tmp)["stdout"].strip()
        if not found.startswith(str(CWD)):
            raise SystemExit(f"the timed processes import nblib from {found}, not from the snapshot {CWD}")
        print(f"nblib at {head} (committed), snapshot in {CWD}", flush=True)
        for job in JOBS:
            results[job] = measure(job, Path(tmp))
            results[job]["breakdown"] = breakdown(job, Path(tmp))
    print("\n".join(verdict(results)))
    if args.json:
        for r in results.values():
            for k in ("cold", "shim compile", "cold trace", "warm"):
                r[k].pop("stdout")
        args.json.write_text(json.dumps({"uptime": uptime, "nblib": head, "model": MODEL, "results": results,
                                         "verdict": verdict(results)}, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
