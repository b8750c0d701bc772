"""What a checkpoint save costs the training loop: loop time added per save, from step timings inside the loop.

A save's cost to the loop is not the time its call blocks: an asynchronous writer takes cores, the GIL
and memory bandwidth from the steps that follow, and a step may wait for a copy the save deferred. So
each writer runs inside a loop of timed steps, and a save's cost is paired within that run (a slow drift
of the machine's load, on a shared machine wider than a save, cancels; `added_per_save`):

    added by a save = the steps from its call until its write ended, plus one, less as many of the run's own
                      steps with no write in flight (their median); plus the final wait for a write

A sync save's window is the step that called it and the next. Each repetition's figure is the median over
its saves; the report gives the median and range over repetitions, and each run's median clean step.

Two loops over the t4 profile's classifier and its AdamW moments (~210 MB of state, as a T4 run holds):
  cpu: CPU-bound: each step multiplies matrices (a fixed amount of work, calibrated once at start to
       about --step-s) and runs AdamW's real step over the whole model (it rewrites the moments in place);
       the writer competes with it for the cores.
  gpu: GPU-like: each step waits (sleeps --step-s), as a loop whose step runs on a GPU waits for it, then
       calls the optimizer's step with no gradients (its pre-hooks run: nblib's fence; no CPU work).
Writers, each saving every --every steps, with --every steps after the last save for its write to end:
  nblib-async:  TrainStore.save with the optimizer guarded, as `train` runs it (serialized on the loop's thread
                when the loop leaves no core spare: the JSON's runs count those saves, `inline_saves`)
  nblib-sync:   TrainStore(sync_save=True).save (atomic, digest, fsync, record last) on the loop's thread
  accelerate:   Accelerator(cpu=True).save_state (safetensors weights, torch.save'd optimizer, RNG; no fsync),
                keeping as many saves as nblib (total_limit = TrainStore's keep_last): each deletes its oldest
  acc+fsync:    the durable peer: save_state, then fsync of each file it wrote and of the folders
Every writer saves once before the measured loop, after --every unmeasured steps of it, as a run's first save comes
after its first steps (buffers allocated; the async save's choice between a writer thread and the loop's own
thread made on the loop's demand, not on an idle start); from the keep_last-th save on, every
writer deletes one old save per save (a run's steady state: --saves 6 measures it).
Repetitions are interleaved (loop, then writers in a rotating order).
Goals (issue 39): gpu loop: nblib-async adds <= 0.25x of nblib-sync; cpu loop: nblib-async adds <=
accelerate's sync save; nblib-sync <= 1.2x acc+fsync.

Run (accelerate is not a requirement of nblib: a venv of its own that shares this one's torch):
  python -m venv /tmp/acc-venv && echo "$(.venv/bin/python -c 'import site; print(site.getsitepackages()[0])')" \\
    > "$(/tmp/acc-venv/bin/python -c 'import site; print(site.getsitepackages()[0])')/project.pth" && \\
    /tmp/acc-venv/bin/pip install accelerate
  PYTHONPATH=. /tmp/acc-venv/bin/python benchmarks/save_loop_cost.py [--repeats 4] [--saves 3] [--json]
Without accelerate importable the accelerate rows are left out (and said so).
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"
LOOPS = ("gpu", "cpu")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--profile", default="t4", help="the classifier whose state is saved (t4: ~210 MB)")
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--saves", type=int, default=6, help="saves per loop (from the 3rd, each deletes one)")
    p.add_argument("--every", type=int, default=8, help="steps between saves (their time: longer than a write)")
    p.add_argument("--step-s", type=float, default=0.5, help="a step's time without saves (about)")
    p.add_argument("--loops", default=",".join(LOOPS))
    p.add_argument("--json", action="store_true", help="write benchmarks/results/save_loop_cost.json")
    args = p.parse_args()
    args.load_start, args.command = list(os.getloadavg()), " ".join(["python", *sys.argv])
    job = Job(args.profile, args.step_s)
    writers = available_writers()
    folder = Path(tempfile.mkdtemp(prefix="nblib-loop-cost-"))
    runs: dict = {loop: {name: [] for name in writers} for loop in args.loops.split(",")}
    try:
        for r in range(args.repeats):
            for loop in runs:
                names = list(writers)
                for name in names[r % len(names):] + names[:r % len(names)]:    # rotate: no writer always first
                    runs[loop][name].append(run_loop(job, loop, writers[name], folder / f"{loop}-{name}-{r}",
                                                     args.saves, args.every))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    result = summarize(runs, args, job)
    print(report(result))
    if args.json:
        out = RESULTS / "save_loop_cost.json"
        out.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
        print(f"wrote {out}")


class Job:
    """The model and optimizer saved, and the two kinds of step."""

    def __init__(self, profile: str, step_s: float):
        from nblib.store.staging import storage_bytes
        from nblib.train.model import Classifier
        from nblib.train.task import model_config

        torch.manual_seed(0)
        self.model = Classifier(model_config(profile).model, 12)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, foreach=False)
        self.grads = [torch.full_like(p, 1e-3) for p in self.params]
        self.set_grads(True)
        self.optimizer.step()                                  # the moments exist: the state a run saves
        self.state_bytes = storage_bytes(self.state())
        self.a, self.b = torch.randn(512, 512), torch.randn(512, 512)
        for _ in range(3):                                     # warm: the first steps touch fresh pages
            self.optimizer.step()
        self.adamw_s = statistics.median(self._timed(self.optimizer.step) for _ in range(5))
        per_mm = statistics.median(self._timed(lambda: torch.mm(self.a, self.b)) for _ in range(20))
        self.mms = max(1, round(max(0.0, step_s - self.adamw_s) / per_mm))
        self.step_s = step_s

    def state(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def set_grads(self, on: bool) -> None:
        for p, g in zip(self.params, self.grads):
            p.grad = g if on else None

    def step(self, loop: str) -> None:
        if loop == "cpu":
            for _ in range(self.mms):
                torch.mm(self.a, self.b)
            self.optimizer.step()                             # AdamW over the whole model: moments edited in place
        else:
            time.sleep(self.step_s)                           # forward and backward on the GPU: the loop waits
            self.optimizer.step()                             # no gradients: its pre-hooks only (nblib's fence)

    @staticmethod
    def _timed(fn) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start


def available_writers() -> dict:
    """{name: factory(job, folder) -> writer}; the accelerate ones only where accelerate is importable."""
    writers = {"nblib-async": NblibWriter.asynchronous, "nblib-sync": NblibWriter.synchronous}
    try:
        import accelerate  # noqa: F401
    except ImportError:
        print("accelerate is not importable here: its rows are left out (see the docstring's Run)")
        return writers
    writers["accelerate"] = lambda job, folder: AccelerateWriter(job, folder, durable=False)
    writers["acc+fsync"] = lambda job, folder: AccelerateWriter(job, folder, durable=True)
    return writers


class NblibWriter:
    """nblib's TrainStore, as `train` drives it: save(state, step), wait_saves at the end."""

    def __init__(self, job: Job, folder: Path, sync: bool):
        from nblib.train.store import TrainStore

        self.job, self.store = job, TrainStore(folder, sync_save=sync)
        self.store.guard(job.optimizer)                        # a no-op for a sync store

    @classmethod
    def asynchronous(cls, job, folder):
        return cls(job, folder, sync=False)

    @classmethod
    def synchronous(cls, job, folder):
        return cls(job, folder, sync=True)

    def save(self, step: int) -> None:
        self.store.save(self.job.state(), step, backup=False)

    def finish(self) -> None:
        self.store.wait_saves()

    def in_flight(self) -> bool:
        return self.store.manager.writing

    def inline_saves(self) -> int:
        """Saves the store serialized on the loop's thread (no spare core), the unmeasured first one included."""
        return self.store.manager.inline_saves

    def close(self) -> None:
        self.store.close()


class AccelerateWriter:
    """accelerate's save_state of the prepared model and optimizer, to one folder per save; `durable`: then
    fsync each file it wrote, its folder and the parent (what nblib's sync save pays for).
    """

    def __init__(self, job: Job, folder: Path, durable: bool):
        from accelerate import Accelerator
        from accelerate.utils import ProjectConfiguration

        from nblib.train.store import TrainStore

        self.folder, self.durable = folder, durable
        # as many saves kept as nblib keeps (its keep_last): both delete one old save per save once full, so
        # neither pays the other's cost of writing into memory nothing freed (on this VM ~0.3 s per 210 MB)
        keep = inspect.signature(TrainStore).parameters["keep_last"].default
        self.accelerator = Accelerator(cpu=True, project_config=ProjectConfiguration(
            project_dir=str(folder), automatic_checkpoint_naming=True, total_limit=keep))
        self.accelerator.prepare(job.model, job.optimizer)

    def save(self, step: int) -> None:
        self.accelerator.save_state()
        where = Path(self.accelerator.project_dir) / "checkpoints" / f"checkpoint_{self.accelerator.save_iteration - 1}"
        if self.durable:
            for path in where.rglob("*"):
                if path.is_file():
                    fd = os.open(path, os.O_RDONLY)
                    try:
                        os.fsync(fd)
                    finally:
                        os.close(fd)
            for folder in (where, where.parent):
                fd = os.open(folder, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)

    def finish(self) -> None:
        pass

    def in_flight(self) -> bool:
        return False

    def inline_saves(self) -> int:
        return 0

    def close(self) -> None:
        pass


def run_loop(job: Job, loop: str, factory, folder: Path, saves: int, every: int) -> dict:
    """One loop of (saves + 1) * every timed steps, saving every `every` steps: each step's seconds and process
    CPU seconds, the steps that called a save, and the steps at whose end a write was still in flight.
    """
    job.set_grads(loop == "cpu")
    folder.mkdir(parents=True)
    writer = factory(job, folder)
    for _ in range(every):                                   # the loop runs before its first save, as a run does:
        job.step(loop)                                       # nblib's async save sees the loop's demand (SpareCore)
    writer.save(0)                                           # buffers allocated, files created once: steady state
    writer.finish()
    steps, cpu, saved, busy = [], [], [], []
    for step in range(1, (saves + 1) * every + 1):
        start, start_cpu = time.perf_counter(), _cpu_s()
        job.step(loop)
        if step % every == 0 and step <= saves * every:
            writer.save(step)
            saved.append(step - 1)
        if writer.in_flight():
            busy.append(step - 1)
        steps.append(time.perf_counter() - start)
        cpu.append(_cpu_s() - start_cpu)
    start, start_cpu = time.perf_counter(), _cpu_s()
    writer.finish()                                          # a write still running at the end is the loop's
    tail, tail_cpu = time.perf_counter() - start, _cpu_s() - start_cpu
    inline = writer.inline_saves()
    writer.close()
    shutil.rmtree(folder, ignore_errors=True)
    return {"steps_s": steps, "cpu_s": cpu, "saved": saved, "busy": busy, "tail_s": tail, "tail_cpu_s": tail_cpu,
            "inline_saves": inline}


def added_per_save(run: dict, key: str = "steps_s") -> tuple[list[float], float]:
    """([seconds each save added to the loop], the run's median step without a write), paired within the run.

    A save's window: the step that called it, every step at whose end its write was in flight, and one
    step more (a slowdown that outlasts the write: writeback, evicted caches). What the window took beyond
    as many of the run's own steps outside every window (their median) is what the save added, plus the
    wait at the end for a write still in flight. A slow drift of the machine's load cancels: both sides
    are steps of the same run, seconds apart.
    """
    values, tail = run[key], run["tail_s" if key == "steps_s" else "tail_cpu_s"]
    windows = []
    for i in run["saved"]:
        j = i
        while j in run["busy"]:
            j += 1
        windows.append(range(i, min(j + 1, len(values) - 1) + 1))
    inside = {i for w in windows for i in w}
    clean = statistics.median(v for i, v in enumerate(values) if i not in inside)
    added = [sum(values[i] - clean for i in w) for w in windows]
    added[-1] += tail
    return added, clean


def _cpu_s() -> float:
    """This process's CPU seconds (user + system, every thread): a save's CPU work, whatever waits it adds."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def summarize(runs: dict, args, job: Job) -> dict:
    """Per loop and writer: each repetition's added seconds per save (the median of its saves, paired within
    the run: `added_per_save`), their median over repetitions, and the goals' ratios of medians.
    """
    loops = {}
    for loop, by_writer in runs.items():
        added, cpu, clean = {}, {}, {}
        for name, reps in by_writer.items():
            added[name] = [statistics.median(added_per_save(run)[0]) for run in reps]
            clean[name] = [added_per_save(run)[1] for run in reps]
            cpu[name] = statistics.median(statistics.median(added_per_save(run, "cpu_s")[0]) for run in reps)
        loops[loop] = {"added_per_save_s": added, "step_without_write_s": clean,
                       "median_added_s": {name: statistics.median(v) for name, v in added.items()},
                       "cpu_per_save_s": cpu, "runs": by_writer}
    return {"kind": "nblib.bench.save_loop_cost/2", "profile": args.profile, "state_bytes": job.state_bytes,
            "repeats": args.repeats, "saves_per_loop": args.saves, "every": args.every, "step_s": args.step_s,
            "cpu_step": {"matmuls": job.mms, "adamw_s": job.adamw_s}, "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
            "load_average": {"start": args.load_start, "end": list(os.getloadavg())},
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": args.command,
            "loops": loops, "goals": goals(loops)}


def goals(loops: dict) -> list[dict]:
    """The issue's three goals, each as measured (a ratio of medians), its limit, and whether it holds."""
    out = []

    def ratio(loop, a, b, limit, what):
        med = loops.get(loop, {}).get("median_added_s", {})
        if a in med and b in med:
            value = max(med[a], 0.0) / med[b] if med[b] > 0 else None     # a reference at or below 0: noise
            out.append({"goal": what, "loop": loop, "ratio": value, "limit": limit,
                        "met": None if value is None else value <= limit})

    ratio("gpu", "nblib-async", "nblib-sync", 0.25, "gpu loop: nblib-async / nblib-sync")
    ratio("cpu", "nblib-async", "accelerate", 1.0, "cpu loop: nblib-async / accelerate")
    for loop in loops:
        ratio(loop, "nblib-sync", "acc+fsync", 1.2, f"{loop} loop: nblib-sync / acc+fsync")
    return out


def report(result: dict) -> str:
    load = result["load_average"]
    lines = [f"loop time added per save, profile {result['profile']} ({result['state_bytes'] / 1e6:.0f} MB of state), "
             f"{result['saves_per_loop']} saves every {result['every']} steps of ~{result['step_s']} s, "
             f"{result['repeats']} interleaved repeats, {result['cpu_count']} CPUs, torch threads "
             f"{result['torch_threads']}, load average {' '.join(f'{v:.2f}' for v in load['start'])} at start, "
             f"{' '.join(f'{v:.2f}' for v in load['end'])} at end"]
    for loop, data in result["loops"].items():
        clean = [v for values in data["step_without_write_s"].values() for v in values]
        lines.append(f"{loop} loop (a step without a write: median {statistics.median(clean):.3f} s, "
                     f"{min(clean):.3f}-{max(clean):.3f} over runs); added per save, median [min-max] over repeats; "
                     f"process CPU s per save:")
        sync = data["median_added_s"].get("nblib-sync")
        for name, values in data["added_per_save_s"].items():
            vs = f"{statistics.median(values) / sync:6.2f}x nblib-sync" if sync and sync > 0 else ""
            lines.append(f"  {name:<12}{statistics.median(values):8.3f} [{min(values):.3f}-{max(values):.3f}]  {vs}"
                         f"   CPU {data['cpu_per_save_s'][name]:.3f}")
    for g in result["goals"]:
        if g["ratio"] is None:
            lines.append(f"goal {g['goal']} (<= {g['limit']}): not measured, the reference's cost <= 0 (noise)")
        else:
            lines.append(f"goal {g['goal']} = {g['ratio']:.2f} (<= {g['limit']}): {'met' if g['met'] else 'MISSED'}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
