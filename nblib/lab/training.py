"""Notebook 06's demos: the training budget against measurements, the largest batch, a kill and an exact
resume, what a checkpoint holds, retention and the bucket's cost. Verdicts come from comparisons
computed here, never typed. Real subprocesses for peaks and kills; the same `train` as the CLI.
"""
from __future__ import annotations

import math
import subprocess
from pathlib import Path

import nblib.train  # noqa: F401  hands the training job to the trace layer (06 budgets training)
from nblib.budget.training import largest_batch, predict_training, retained_bytes, retained_versions, t4_training_time
from nblib.cache import sample_texts_path
from nblib.compare import progress_bar
from nblib.proc import cli_command, run_until
from nblib.units import fmt_bytes, fmt_duration

REPO = Path(__file__).resolve().parents[2]
PEAK_TOLERANCE = 0.10


def texts_subset(n: int, folder: str | Path) -> Path:
    """The first `n` sample texts as a .jsonl in `folder` (the cache records its path: labels come with it)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"sample_texts_{n}.jsonl"
    lines = sample_texts_path().read_text(encoding="utf-8").splitlines(keepends=True)[:n]
    path.write_text("".join(lines), encoding="utf-8")
    return path


def label_shares(texts_path: str | Path) -> str:
    """Each label the loop can train on (`scan_labels`: the texts' kind, or their script) and its classes' shares:
    the smallest and the largest, against chance (one over the number of classes).
    """
    import numpy as np

    from nblib.train.data import scan_labels

    lines = []
    for labels in ("kind", "script"):
        ids, classes, _ = scan_labels(texts_path, labels)
        shares = np.bincount(ids, minlength=len(classes)) / len(ids)
        lines.append(f"{labels:<7} {len(classes)} classes (chance {1 / len(classes):.1%}): each {shares.min():.1%}-"
                     f"{shares.max():.1%} of the {len(ids):,} texts, the largest '{classes[int(shares.argmax())]}'")
    return "\n".join(lines)


def memory_rows(model, batches: tuple[int, ...], progress: bool = True) -> list[dict]:
    """Per batch: the step's predicted peak RSS (measured fixed cost + predicted step) and the measured one."""
    from nblib.train.probe import step_peak

    rows = []
    with progress_bar(len(batches), "measuring steps", "batch", disable=not progress) as bar:
        for b in batches:
            measured = step_peak(model, b)
            budget = predict_training(model, b)
            predicted = measured.rss_before + budget.step_bytes
            rows.append({"batch": b, "fixed": measured.rss_before, "predicted": predicted,
                         "measured": measured.peak_rss,
                         "ratio": predicted / measured.peak_rss if measured.peak_rss else float("nan"),
                         "step_share": (measured.peak_rss - measured.rss_before) / max(1, measured.peak_rss),
                         "full_prediction": budget.total})
            bar.update(1)
    return rows


def memory_table(rows: list[dict]) -> str:
    head = (f"{'batch':>6}{'fixed (measured)':>18}{'peak predicted':>16}{'peak measured':>15}{'pred/meas':>11}"
            f"{'step share':>12}   verdict")
    lines = [head]
    for r in rows:
        dominated = r["step_share"] >= 0.5
        ok = abs(r["ratio"] - 1) <= PEAK_TOLERANCE
        verdict = (("within" if ok else "OUTSIDE") + f" +-{PEAK_TOLERANCE:.0%}") if dominated else \
            "fixed cost dominates: not judged"
        lines.append(f"{r['batch']:>6}{fmt_bytes(r['fixed']):>18}{fmt_bytes(r['predicted']):>16}"
                     f"{fmt_bytes(r['measured']):>15}{r['ratio']:>11.3f}{r['step_share']:>12.0%}   {verdict}")
    return "\n".join(lines)


def largest_batch_demo(model, cap_bytes: int, progress: bool = True, device: str | None = None) -> tuple[int, list]:
    """(the budget's largest micro-batch under the cap, the probes on the device training uses that confirm it).

    device: None, the loop's (`nblib.train.device.check_device`: cuda on a T4). On CPU the cap is what a step
    adds (the closed-form budget, `largest_batch`); on CUDA all the device memory the process may reserve (the
    traced budget, `nblib.budget.model_vram`, on a T4 whose memory is the cap).
    """
    import dataclasses

    from nblib.train.device import check_device
    from nblib.train.probe import probe_largest_batch

    device = check_device(device)
    if device.startswith("cuda"):
        from nblib.budget.devices import device_preset
        from nblib.budget.model_vram import model_vram

        capped = dataclasses.replace(device_preset("t4"), name=f"T4 capped at {fmt_bytes(cap_bytes)}",
                                     vram_bytes=cap_bytes, cuda_context_bytes=0)
        predicted = model_vram(model, 1, capped, precision="fp32", train=True).largest_batch or 0
    else:
        predicted = largest_batch(model, cap_bytes, step_only=True)
    return predicted, probe_largest_batch(model, cap_bytes, predicted, tries=3, progress=progress, device=device)


def probed_words(predicted: int, probes: list) -> str:
    """What the probes say of the largest batch (an interval, not one of the probes), and where the budget's
    answer falls in it.
    """
    from nblib.train.probe import probed_interval

    low, high = probed_interval(probes)
    where = f"{low}-{high}" if high is not None else f"{low} or more (no larger probe ran out of memory)"
    inside = low <= predicted and (high is None or predicted <= high)
    return (f"largest batch under the cap, as the probes bound it: {where}; the budget's {predicted} is "
            + ("inside that interval" if inside else
               f"{'below' if predicted < low else 'above'} it ({predicted / max(1, low):.2f} x the largest that ran)"))


def train_command(cache: str | Path, out: str | Path, steps: int, *extra: str) -> list[str]:
    return [*cli_command("train", cache=cache, out=out, steps=steps, no_progress=True), *extra]


def kill_and_resume(cache: str | Path, folder: str | Path, steps: int, kill_after_step: int,
                    *extra: str, progress: bool = True) -> dict:
    """An uninterrupted CLI run, and one SIGKILLed once step `kill_after_step` is saved, then rerun."""
    import os

    folder = Path(folder)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    whole, killed = folder / "uninterrupted", folder / "killed"
    with progress_bar(3, "uninterrupted run, killed run, rerun", "run", disable=not progress) as bar:
        subprocess.run(train_command(cache, whole, steps, *extra), env=env, check=True, capture_output=True)
        bar.update(1)
        run_until(train_command(cache, killed, steps, *extra), lambda: _newest_step(killed) >= kill_after_step,
                  timeout=math.inf, env=env)
        bar.update(1)
        at_kill = _newest_step(killed)
        finished_before_kill = (killed / "final.pt").exists()
        rerun = subprocess.run(train_command(cache, killed, steps, *extra), env=env, check=True,
                               capture_output=True, text=True)
        bar.update(1)
    return {"killed_after_saved_step": at_kill, "finished_before_kill": finished_before_kill,
            "rerun_output": rerun.stdout.strip(), "identical": weights_identical(whole, killed)}


def weights_identical(run_a: str | Path, run_b: str | Path) -> bool:
    """True when both runs' final.pt hold the same tensors, bit for bit (encoder and head)."""
    import torch

    a = torch.load(Path(run_a) / "final.pt", weights_only=True)
    b = torch.load(Path(run_b) / "final.pt", weights_only=True)
    flat = lambda p: {**p["state_dict"], **{f"head.{k}": v for k, v in p["head"].items()}}  # noqa: E731
    fa, fb = flat(a), flat(b)
    return fa.keys() == fb.keys() and all(torch.equal(fa[k], fb[k]) for k in fa)


def newest_state(run_dir: str | Path) -> dict:
    from nblib.train.store import TrainStore

    state, _ = TrainStore(run_dir, start_mirror=False).load_latest()
    return state


def checkpoint_contents(state: dict, *, buffer_size: int = 250_000, sample_bytes: int = 500_000) -> str:
    """What a train state holds, by part, beside what tf.data's Dataset.shuffle checkpoint holds."""
    from nblib.budget import shuffle_checkpoint
    from nblib.train.state import part_bytes

    counters = {k: v for k, v in state.items() if v is None or isinstance(v, (int, float))}
    sizes = part_bytes({k: v for k, v in state.items() if k not in counters})
    names = {"model": "model weights + BatchNorm stats", "optimizer": "AdamW moments + step counts",
             "scheduler": "LR schedule", "scaler": "GradScaler", "rng": "RNG states (python, numpy, torch)",
             "data_order": "data order (nblib shuffle state)", "history": "metric history",
             "identity": "run identity (settings, cache, labels)", "step": "step", "epoch": "epoch",
             "best": "best step"}
    lines = [f"{'part':<42}{'bytes in the checkpoint':>24}"]
    for key, value in sorted(sizes.items(), key=lambda kv: -kv[1]):
        lines.append(f"{names.get(key, key):<42}{value:>24,}")
    lines.append(f"{'all parts (less torch.save containers)':<42}{sum(sizes.values()):>24,}")
    if counters:
        lines.append("counters (a few bytes each): " + ", ".join(f"{names.get(k, k)} {v}" for k, v in counters.items()))
    saved, text = sizes["data_order"], len(state["data_order"])
    tf = shuffle_checkpoint(buffer_size, sample_bytes).checkpoint_bytes
    lines.append("")
    lines.append(f"data order, nblib: {text:,} bytes of JSON, {saved:,} in the checkpoint (the row above), at any "
                 f"dataset size")
    lines.append(f"data order, tf.data Dataset.shuffle(buffer_size={buffer_size:,}) of {fmt_bytes(sample_bytes)} "
                 f"samples: {fmt_bytes(tf)} (the buffer itself; reference arithmetic, nblib.budget.shuffle_checkpoint)")
    lines.append(f"in all: {fmt_bytes(max(saved, text))} of data order against {fmt_bytes(tf)} of shuffle buffer")
    return "\n".join(lines)


def retention_listing(run_dir: str | Path, mirror: str | Path | None, keep_last: int = 3) -> str:
    """The state and best versions kept on each side, their bytes on disk, and what the one retention rule
    (`nblib.budget.training.retained_bytes`, which the budget and the bucket's cost use) gives with these
    files' sizes.
    """
    sides = (("local", Path(run_dir)), ("mirror", None if mirror is None else Path(mirror)))
    return "\n".join(_retention_line(side, _file_sizes(root / "checkpoints"), keep_last) for side, root in sides
                     if root is not None and (root / "checkpoints").exists())


def version_bytes(root: str | Path, name: str) -> int:
    """Bytes of the newest version of series `name` in a checkpoints folder: its .pt and its record."""
    return _newest_bytes(_file_sizes(Path(root)), name)


def _file_sizes(root: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in root.iterdir() if p.is_file()}


def _newest_bytes(held: dict[str, int], name: str) -> int:
    """Bytes of the newest version of series `name` among `held` (file name -> bytes): its .pt and its record."""
    from nblib.store.checkpoints import stem, versions_in

    versions = versions_in(held, name)
    return sum(held.get(f"{stem(name, versions[-1])}{ext}", 0) for ext in (".pt", ".json")) if versions else 0


def _retention_line(side: str, held: dict[str, int], keep_last: int) -> str:
    """A side's state and best versions, their bytes, and what the one retention rule gives with their sizes."""
    from nblib.store.checkpoints import versions_in

    size = sum(v for k, v in held.items() if k.startswith(("state-", "best-")))
    states_kept, bests_kept = retained_versions(keep_last)
    rule = retained_bytes(_newest_bytes(held, "state"), _newest_bytes(held, "best"), keep_last)
    return (f"{side:<7} states at steps {versions_in(held, 'state')}, best at steps {versions_in(held, 'best')}: "
            f"{fmt_bytes(size)}{'' if side == 'bucket' else ' on disk'}; the rule (last {states_kept} states + "
            f"{bests_kept} best) with these files' sizes: {fmt_bytes(rule)}")


BUCKET = "nblib-demo"


def bucket_backup_demo(cache: str | Path, folder: str | Path, config, *, bucket: str = BUCKET,
                       progress: bool = True) -> str:
    """A short run backed up to an S3 bucket on a local S3-compatible server (moto's, on 127.0.0.1, stopped
    after): what the bucket holds, by the one retention rule. Where moto or s3fs is missing, says why it is
    skipped. The same `train(..., mirror="s3://bucket/prefix", storage_options=...)` backs up to a real bucket.
    `progress`: the suite's bar over the whole demo: the server's start, each training step, the bucket's listing.
    """
    import importlib.util
    import logging
    import socket

    missing = [m for m in ("moto", "s3fs") if importlib.util.find_spec(m) is None]
    if missing:
        return (f"bucket demo skipped: {' and '.join(missing)} not installed here (pip install 'moto[server]' "
                f"s3fs); a real bucket takes the same train(..., mirror='s3://bucket/prefix')")
    bar = progress_bar(config.steps + 2, "S3 server, training steps, listing", "step", disable=not progress)
    from moto.server import ThreadedMotoServer

    from nblib.train import train
    from nblib.train.objstore import open_filesystem

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    endpoint = f"http://127.0.0.1:{port}"
    options = {"key": "testing", "secret": "testing", "endpoint_url": endpoint}   # moto takes any key
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    requests_log = logging.getLogger("werkzeug")        # the server logs every request otherwise
    level = requests_log.level
    requests_log.setLevel(logging.ERROR)
    server.start()
    bar.update()
    try:
        fs = open_filesystem("s3", options)
        fs.mkdir(bucket)                      # the run never creates a bucket: a mistyped name is refused
        report = train(cache, Path(folder), config, mirror=f"s3://{bucket}/run", storage_options=options,
                       on_step=lambda step, _: bar.update(1 + step - bar.n))
        held = {Path(e["name"]).name: e["size"] for e in fs.ls(f"{bucket}/run/checkpoints", detail=True)}
        bar.update(bar.total - bar.n)
    finally:
        server.stop()                         # nothing of this cell keeps running
        requests_log.setLevel(level)
        bar.close()
    return "\n".join([f"bucket s3://{bucket}/run on moto's S3 server at {endpoint} (a local stand-in for S3; stopped "
                      f"after this cell)", _retention_line("bucket", held, config.keep_last),
                      report.durability.line() if report.durability is not None else ""])


def _newest_step(run: Path) -> int:
    return max((int(p.stem.split("-")[1]) for p in (run / "checkpoints").glob("state-*.json")), default=0)


def simulated_t4_rows(model, batches: tuple[int, ...], precision: str = "fp16", progress: bool = True) -> list[dict]:
    """Per batch: the traced VRAM budget (`model_vram(train=True)`, replayed from batches 2, 3 and 64) and the
    simulated T4 running the same traced step at the batch itself (`simulate_train_step`), with its roofline time.
    `progress`: the suite's bar over the trace (the longer part on a cold trace cache) and each simulated batch.
    """
    from nblib.budget.model_vram import model_vram_table
    from nblib.simulate.train import simulate_train_step

    rows = []
    with progress_bar(1 + len(batches), "T4: trace the budget, simulate each batch", "step",
                      disable=not progress) as bar:
        budgets = model_vram_table(model, batches, "t4", precision=precision, train=True, find_largest=False)
        bar.update()
        for b, vram in zip(batches, budgets):
            sim = simulate_train_step(model, b, "t4", precision=precision)
            rows.append({"batch": b, "precision": precision, "budget": vram.reserved, "allocated": sim.max_allocated,
                         "reserved": sim.max_reserved, "ratio": vram.reserved / sim.max_reserved,
                         "step_s": sim.step_seconds(), "attention": sim.sdpa_backend, "peak_op": sim.peak_op})
            bar.update()
    return rows


def simulated_t4_table(rows: list[dict]) -> str:
    """The rows of `simulated_t4_rows` as a table, each judged against +-10%."""
    lines = [f"{'batch':>6}{'precision':>10}{'budget (traced)':>17}{'simulated allocated':>21}"
             f"{'simulated reserved':>20}{'budget/simulated':>18}   verdict"]
    for r in rows:
        ok = abs(r["ratio"] - 1) <= PEAK_TOLERANCE
        lines.append(f"{r['batch']:>6}{r['precision']:>10}{fmt_bytes(r['budget']):>17}{fmt_bytes(r['allocated']):>21}"
                     f"{fmt_bytes(r['reserved']):>20}{r['ratio']:>18.3f}   "
                     f"{'within' if ok else 'OUTSIDE'} +-{PEAK_TOLERANCE:.0%}")
    for r in rows:
        lines.append(f"batch {r['batch']}: roofline step time (simulated ceiling) {fmt_duration(r['step_s'])} = "
                     f"{r['batch'] / r['step_s']:,.0f} samples/s at most; {r['attention']} attention; "
                     f"peak at {r['peak_op']}")
    return "\n".join(lines)


def t4_training_time_lines(model, steps: int, batch: int, rows: list[dict], precision: str = "fp16") -> str:
    """The T4 training time of `steps` steps of `batch` (`t4_training_time`, a projection) and the simulated
    roofline of `rows` as its ceiling.
    """
    time = t4_training_time(model, steps * batch, precision)
    lines = [f"T4 training time of {steps:,} steps x batch {batch} = {steps * batch:,} samples: {time.summary()}",
             f"  how: {time.method}"]
    for r in rows:
        ceiling = r["batch"] / r["step_s"]
        lines.append(f"  ceiling at batch {r['batch']}: {ceiling:,.0f} samples/s (simulated roofline); the "
                     f"projection's fast end {time.samples_per_s.high:,.0f} is "
                     f"{'below it' if time.samples_per_s.high <= ceiling else 'ABOVE it: the projection is too fast'}")
    return "\n".join(lines)
