"""Saving and loading a train state: nblib's store (synchronous and asynchronous) against the peers.

For the smoke and t4 encoders + head with AdamW state, side by side, interleaved repeats:
  nblib-sync:  TrainStore(sync_save=True).save: torch.save streamed into the atomic writer (temporary,
               sha256 while writing, fsync, rename, fsync folder), the record last, on the loop's thread
  nblib-async: TrainStore.save with the optimizer guarded, as the train loop runs it: the loop blocks while
               the state is walked and the tensors the next forward may change are copied (model buffers);
               the writer thread copies the weights and moments into reused host buffers and writes them.
               The loop then runs its next real step (forward, backward, AdamW step), whose step waits until
               those copies are done: blocking = save's return + that wait. Save time is the writer's job.
  torch.save:  torch.save(state, path) straight to the file, no fsync, no hash (what accelerate's
               save_state does for every object but the weights): the floor of a torch.save-based writer,
               shown as block/bare; the goals compare with the tools (`peers_of`: DCP and accelerate, with
               torch.save standing in for accelerate where accelerate is not importable)
  dcp:         torch.distributed.checkpoint.save to a folder (FileSystemWriter: one file per rank + .metadata)
  dcp-async:   torch.distributed.checkpoint.async_save: the loop blocks for DCP's staging copy
  accelerate:  Accelerator(cpu=True).save_state of the prepared model and optimizer (model.safetensors,
               optimizer.bin, RNG states; no fsync, no hash), where accelerate is importable (it is not a
               requirement: `pip install --no-deps --target DIR accelerate` and PYTHONPATH=DIR); load_state back
Loads are resumes: each ends with the state in the model and the optimizer (`load_state_dict`), as
accelerate's load_state does, so a loader that maps its file (nblib's local load, safetensors) pays
for the pages it defers. nblib's `TrainStore.load_latest` (the digest checked against the record),
torch.load of the torch.save file, dcp.load of the whole state (weights and optimizer) in place into the
live tensors, accelerate's load_state.
Host RAM: the peak RSS above the baseline while one async save is staged and written, sampled every
millisecond, in snapshots (the state's bytes); goal: at most one.
Prints save, blocking and load time (min / median / max of the repeats), bytes on disk, blocking time
against nblib-sync and against the fastest peer; `--json` writes them under benchmarks/results/.
Blocking is what the save call and the next step's wait take, not what a save costs the loop: the writer
then takes cores and memory bandwidth from the steps that follow. `benchmarks/save_loop_cost.py` measures
that (loop time added per save, from step timings, against a loop without saves).
Run: python benchmarks/train_checkpoint.py [--profile smoke|t4] [--repeats 7] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

import psutil
import torch

RESULTS = Path(__file__).parent / "results"
NEXT_STEP: list[tuple[float, float, float]] = []   # nblib-async: (save returned, next step waited, step) seconds


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--profile", default="smoke")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--json", action="store_true", help="write the results under benchmarks/results/")
    p.add_argument("--label", default="", help="a tag for the JSON file name (e.g. before, after)")
    args = p.parse_args()
    model, optimizer = make_job(args.profile)
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    folder = Path(tempfile.mkdtemp(prefix="nblib-ckpt-bench-"))
    savers = {"nblib-sync": save_nblib_sync, "nblib-async": lambda state, where: save_nblib_async(
                  state, where, model, optimizer), "torch.save": save_torch,
              "dcp": save_dcp, "dcp-async": save_dcp_async}
    loaders = {"nblib-sync": load_nblib, "torch.save": load_torch, "dcp": load_dcp}
    loaders = {name: resuming(load, model, optimizer) for name, load in loaders.items()}
    accelerator = prepared_accelerator(model, optimizer)
    if accelerator is None:
        print("accelerate is not importable here: its row is left out")
    else:
        savers["accelerate"] = lambda _state, where: save_accelerate(accelerator, where)
        loaders["accelerate"] = lambda _state, where: load_accelerate(accelerator, where)
    rows = {name: [] for name in savers}
    loads: dict[str, list[float]] = {name: [] for name in loaders}
    try:
        for r in range(args.repeats):                          # interleaved: load drifts hit all alike
            for name in savers:
                where = folder / f"{name}-{r}"
                rows[name].append(savers[name](state, where))
                if name in loaders:
                    loads[name].append(loaders[name](state, where))
                shutil.rmtree(where, ignore_errors=True)
        ram = snapshots_held(state, folder / "ram", optimizer)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    load_avg = os.getloadavg()
    print(f"train state of profile {args.profile}: {sum(v.numel() for v in state['model'].values()):,} "
          f"parameters, {state_bytes(state) / 2**20:.1f} MiB; min / median / max of {args.repeats} interleaved "
          f"repeats; load average {load_avg[0]:.2f} {load_avg[1]:.2f} {load_avg[2]:.2f}")
    print(table(rows, loads))
    returned, waited, step = (statistics.median(v[i] for v in NEXT_STEP) for i in range(3))
    print(f"nblib-async: save returned in {returned * 1e3:.2f} ms, the next step waited {waited * 1e3:.3f} ms for the "
          f"deferred copies (max {max(v[1] for v in NEXT_STEP) * 1e3:.3f} ms) in a {step * 1e3:.1f} ms step (medians)")
    print(f"host RAM during one async save: peak {ram:.2f} snapshots above the baseline (goal <= 1)")
    if args.json:
        write_json(args, rows, loads, ram, load_avg)


def peers_of(rows: dict) -> list[str]:
    """The tools the goals compare with: DCP and accelerate (the issue's peers; Lightning is not installed
    here); a bare torch.save stands in for accelerate where accelerate is not importable.
    """
    return ["dcp", "accelerate" if "accelerate" in rows else "torch.save"]


def table(rows: dict, loads: dict) -> str:
    """One line per writer: save, blocking, load (min / median / max ms), bytes, ratios.

    block/peer and load/peer: against the fastest peer (`peers_of`); block/bare: against a bare torch.save
    to the file (no fsync, no hash), the floor of any torch.save-based writer, not a goal.
    """
    base = statistics.median(v[1] for v in rows["nblib-sync"])
    peers = peers_of(rows)
    fastest = min(statistics.median(v[1] for v in rows[p]) for p in peers)
    fastest_load = min(statistics.median(loads[p]) for p in peers)
    bare = statistics.median(v[1] for v in rows["torch.save"])
    head = (f"{'writer':<12}{'save ms':>20}{'blocking ms':>20}{'load ms':>20}{'bytes':>13}{'block/sync':>11}"
            f"{'block/peer':>11}{'load/peer':>10}{'block/bare':>11}")
    lines = [head]
    for name, values in rows.items():
        block = statistics.median(v[1] for v in values)
        load = f"{_spread(loads[name]):>20}" if name in loads else f"{'-':>20}"
        ratio = f"{statistics.median(loads[name]) / fastest_load:>10.2f}" if name in loads else f"{'-':>10}"
        lines.append(f"{name:<12}{_spread([v[0] for v in values]):>20}{_spread([v[1] for v in values]):>20}"
                     f"{load}{values[0][2]:>13,}{block / base:>11.3f}{block / fastest:>11.2f}{ratio}"
                     f"{block / bare:>11.2f}")
    lines.append(f"peers: {', '.join(peers)} (fastest save {fastest * 1e3:.1f} ms, fastest load "
                 f"{fastest_load * 1e3:.1f} ms); goals: nblib-async block/sync <= 0.10 (the call, not the loop's cost: "
                 f"save_loop_cost.py), nblib-sync block/peer "
                 f"<= 1.2, nblib-sync load/peer <= 1.2, host RAM <= 1 snapshot")
    return "\n".join(lines)


def write_json(args, rows: dict, loads: dict, ram: float, load_avg) -> None:
    body = {"kind": "nblib.bench.train_checkpoint/1", "profile": args.profile, "repeats": args.repeats,
            "label": args.label, "load_average": list(load_avg), "torch": torch.__version__,
            "cpu_count": os.cpu_count(), "ram_snapshots": ram,
            "save_s": {k: [v[0] for v in rows[k]] for k in rows},
            "blocking_s": {k: [v[1] for v in rows[k]] for k in rows},
            "bytes": {k: rows[k][0][2] for k in rows}, "load_s": loads}
    name = f"train-checkpoint-{args.profile}{'-' + args.label if args.label else ''}-{time.strftime('%Y-%m-%d')}.json"
    (RESULTS / name).write_text(json.dumps(body, indent=1, sort_keys=True) + "\n")
    print(f"wrote {RESULTS / name}")


def make_job(profile: str):
    """The profile's classifier and its AdamW after one step (so the optimizer holds its moments)."""
    from nblib.train.loop import model_config
    from nblib.train.model import Classifier

    model = Classifier(model_config(profile).model, 12)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], foreach=False)
    images = torch.randint(0, 256, (2, model.encoder.config.image_size, model.encoder.config.image_size, 3),
                           dtype=torch.uint8)
    torch.nn.functional.cross_entropy(model(images), torch.tensor([0, 1])).backward()
    opt.step()
    return model, opt


def prepared_accelerator(model, optimizer):
    """An Accelerator (CPU) holding the model and optimizer, as a user of accelerate has; None without accelerate."""
    try:
        from accelerate import Accelerator
    except ImportError:
        return None
    accelerator = Accelerator(cpu=True)
    accelerator.prepare(model, optimizer)
    return accelerator


def save_accelerate(accelerator, folder: Path) -> tuple[float, float, int]:
    start = time.perf_counter()
    accelerator.save_state(str(folder))
    took = time.perf_counter() - start
    return took, took, sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def load_accelerate(accelerator, folder: Path) -> float:
    start = time.perf_counter()
    accelerator.load_state(str(folder))
    return time.perf_counter() - start


def state_bytes(state: dict) -> int:
    """One snapshot's bytes: the distinct storages the state holds (nblib.store.staging counts them)."""
    from nblib.store.staging import storage_bytes

    return storage_bytes(state)


def save_nblib_sync(state: dict, folder: Path) -> tuple[float, float, int]:
    from nblib.train.store import TrainStore

    store = TrainStore(folder, sync_save=True)
    start = time.perf_counter()
    store.save(state, 1, backup=False)
    took = time.perf_counter() - start
    store.close()
    return took, took, _size(folder / "checkpoints")


def save_nblib_async(_state: dict, folder: Path, model, optimizer) -> tuple[float, float, int]:
    from nblib.train.store import TrainStore

    # the live state, as the loop takes it at each save (the loaders above swap the optimizer's tensors)
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    store = TrainStore(folder)
    store.guard(optimizer)
    store.save(state, 1, backup=False)            # the first save allocates the staging buffers
    store.wait_saves()
    start = time.perf_counter()
    store.save(state, 2, backup=False)
    returned = time.perf_counter() - start
    fenced, stepped = store.fence_seconds, time.perf_counter()
    train_step(model, optimizer)                  # its AdamW step waits for the save's deferred copies
    NEXT_STEP.append((returned, store.fence_seconds - fenced, time.perf_counter() - stepped))
    blocking = returned + store.fence_seconds - fenced
    store.wait_saves()
    took = store.write_seconds[-1]
    store.close()
    return took, blocking, _size(folder / "checkpoints") // 2


def train_step(model, optimizer) -> None:
    """One real step of the job: forward and backward of two images, then AdamW's step."""
    size = model.encoder.config.image_size
    images = torch.randint(0, 256, (2, size, size, 3), dtype=torch.uint8)
    optimizer.zero_grad()
    torch.nn.functional.cross_entropy(model(images), torch.tensor([0, 1])).backward()
    optimizer.step()


def resuming(load, model, optimizer):
    """`load(state, where) -> loaded state`, timed until the model and the optimizer hold it."""

    def timed(state: dict, where: Path) -> float:
        start = time.perf_counter()
        loaded = load(state, where)
        model.load_state_dict(loaded["model"])
        optimizer.load_state_dict(loaded["optimizer"])
        took = time.perf_counter() - start
        assert torch.equal(optimizer.state_dict()["state"][0]["exp_avg"], state["optimizer"]["state"][0]["exp_avg"])
        return took
    return timed


def load_nblib(state: dict, folder: Path) -> dict:
    from nblib.train.store import TrainStore

    store = TrainStore(folder, sync_save=True)
    loaded, _ = store.load_latest()
    store.close()
    assert loaded is not None
    return loaded


def save_torch(state: dict, folder: Path) -> tuple[float, float, int]:
    folder.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    torch.save(state, folder / "state.pt")
    took = time.perf_counter() - start
    return took, took, _size(folder)


def load_torch(state: dict, folder: Path) -> dict:
    return torch.load(folder / "state.pt", map_location="cpu", weights_only=True)


def save_dcp(state: dict, folder: Path) -> tuple[float, float, int]:
    import torch.distributed.checkpoint as dcp

    start = time.perf_counter()
    dcp.save(state, checkpoint_id=str(folder))
    took = time.perf_counter() - start
    return took, took, _size(folder)


def load_dcp(state: dict, folder: Path) -> dict:
    import torch.distributed.checkpoint as dcp

    dcp.load(state, checkpoint_id=str(folder))    # in place, into the live tensors (DCP's own resume)
    return state


def save_dcp_async(state: dict, folder: Path) -> tuple[float, float, int]:
    import torch.distributed.checkpoint as dcp

    start = time.perf_counter()
    future = dcp.async_save(state, checkpoint_id=str(folder))
    blocking = time.perf_counter() - start
    future.result()
    return time.perf_counter() - start, blocking, _size(folder)


def snapshots_held(state: dict, folder: Path, optimizer) -> float:
    """Peak RSS above the baseline during three async saves in a row, in state sizes."""
    from nblib.train.store import TrainStore

    store = TrainStore(folder)
    store.guard(optimizer)
    store.save(state, 1, backup=False)
    store.wait_saves()
    process, peak, stop = psutil.Process(), [0], threading.Event()
    base = process.memory_info().rss

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], process.memory_info().rss - base)
            time.sleep(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    for step in (2, 3, 4):
        store.save(state, step, backup=False)
    store.wait_saves()
    stop.set()
    sampler.join()
    store.close()
    return peak[0] / state_bytes(state)


def _spread(values: list[float]) -> str:
    """min / median / max in milliseconds."""
    return f"{min(values) * 1e3:.1f}/{statistics.median(values) * 1e3:.1f}/{max(values) * 1e3:.1f}"


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and p.suffix in (".pt", ".distcp", ""))


if __name__ == "__main__":
    main()
