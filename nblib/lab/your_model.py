"""Notebook 07's demos: your own model on a T4, budgeted, simulated, encoded, killed and resumed, trained.

The model is a transformers class built from a config with random weights (nothing downloads): a tiny ViT
on the smoke profile, ViT-B/16's default config on t4/full. Every GPU figure here comes from the one
traced budget (`nblib.budget.model_vram`) or its simulated twin (`nblib.simulate.simulate_model`, the
jobs' own loop on the fake GPU) and is labelled so; a T4 time is `nblib.t4_speed`'s projection. The kill
and resume run the real command line (`python -m nblib encode --model ...`) in subprocesses, and compare
the consolidated outputs byte for byte. Trade-off: each budget and simulation is a fresh process (the
fake-CUDA shim), a second or a few on a CPU, so the notebook checks a few batches, not a sweep.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import nblib.train  # noqa: F401  hands the training job to the trace layer (07 budgets training)
from nblib.budget.model_vram import ModelVRAM, model_vram, reserved_cap
from nblib.budget.resources import FIT_MARGIN
from nblib.compare import progress_bar
from nblib.config import for_profile
from nblib.lab.streaming_encoding import encode_command, run_and_kill
from nblib.simulate.model import SimulatedModelRun, simulate_model

TOLERANCE = 0.10            # the budget's reserved VRAM within +-10% of the simulated loop's (issue 28's bar)
SEARCH_CEILING = 1 << 17    # the largest-batch search stops here (model_vram's own default stops at 4096)
# the smoke profile's model: a ViT that encodes a small cache on one CPU core in seconds, with enough activations
# per image (4 px patches: 257 tokens) that the largest batch on a T4 stays in the thousands, where the simulated
# loop at that batch takes seconds (its host-side batch is real memory)
TINY_VIT = {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 256,
            "patch_size": 4}


def model_spec(profile: str, folder: str | Path, image_size: int) -> str:
    """The notebook's model: smoke, a tiny ViT config written to `folder` at the cache's size; else ViT-B/16."""
    if profile != "smoke":
        return "hf:ViTModel"          # transformers' ViTConfig() defaults: ViT-B/16 at 224 px
    from transformers import ViTConfig

    path = Path(folder) / f"tiny_vit_{image_size}px.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    config = ViTConfig(image_size=image_size, **TINY_VIT).to_dict()
    path.write_text(json.dumps(config, indent=1, sort_keys=True), encoding="utf-8")
    return f"hf:ViTModel:{path}"


def describe(spec: str, image_size: int) -> str:
    """What the model is: its class, parameters, preprocessing, and each output's shape per image."""
    from nblib.models import load_model

    loaded = load_model(spec)
    n_params = sum(p.numel() for p in loaded.module.parameters())
    pre = loaded.preprocessing
    lines = [f"{spec}: {type(loaded.module).__name__}, {n_params:,} parameters, random weights (seeded; nothing "
             f"downloaded)",
             f"  input: the cache's uint8 [B, {image_size}, {image_size}, 3] images -> {pre.layout}, "
             f"{'resized to ' + 'x'.join(map(str, pre.size)) if pre.size else 'at their size'} "
             f"(preprocessing from {pre.source})"]
    shapes = loaded.output_shapes(image_size)
    lines += [f"  output {name:<18} {list(shape)} per image" for name, shape in shapes.items()]
    return "\n".join(lines)


def sample_cache(folder: str | Path, n_texts: int, image_size: int):
    """The first `n_texts` sample texts rendered into a cache under `folder` (their kinds are the training labels)."""
    from nblib.cache import ShardedImageCache, populate
    from nblib.lab.training import texts_subset

    texts = texts_subset(n_texts, folder)
    populate(texts, Path(folder) / "cache", image_size, 1, workers=0, progress=False)
    return ShardedImageCache(Path(folder) / "cache")


def t4_cap(device: str = "t4") -> int:
    """Reserved VRAM a job may reach on the GPU preset (`model_vram.reserved_cap`, the budget's own cap)."""
    return reserved_cap(device)


@dataclass(frozen=True)
class BudgetCheck:
    """One batch: the traced budget and the simulated loop (both simulated T4 figures, no CUDA context)."""

    budget: ModelVRAM
    simulated: SimulatedModelRun

    @property
    def batch(self) -> int:
        return self.budget.batch_size

    @property
    def ratio(self) -> float:
        """Budget / simulation of reserved memory (CUDA context excluded on both sides)."""
        return self.budget.reserved / self.simulated.max_reserved

    @property
    def within(self) -> bool:
        return abs(self.ratio - 1) <= TOLERANCE


def budget_vs_simulated(spec: str, batches: tuple[int, ...], *, train: bool = False, precision: str = "fp16",
                        add_largest: bool = True, progress: bool = True) -> list[BudgetCheck]:
    """The budget (largest batch searched at the first batch) and the simulated loop at each batch, and with
    `add_largest` at the largest batch that fits too: the budget's answer checked where it matters most.
    """
    rows: list[BudgetCheck] = []
    todo = list(batches)
    with progress_bar(len(batches) + add_largest, f"budget and simulation ({'training' if train else 'encoding'})",
                      "batch", disable=not progress) as bar:
        while todo:
            b = todo.pop(0)
            first = not rows
            vram = model_vram(spec, b, "t4", precision=precision, train=train, find_largest=first,
                              max_batch=SEARCH_CEILING)
            if first and add_largest and vram.largest_batch and vram.largest_batch not in batches:
                todo.append(vram.largest_batch)
            rows.append(BudgetCheck(vram, simulate_model(spec, b, "t4", precision=precision, train=train)))
            bar.update(1)
    return rows


def agreement(rows: list[BudgetCheck]) -> str:
    """The verdict over every row, from TOLERANCE (deterministic: both sides are traces)."""
    return (f"budget within {TOLERANCE:.0%} of the simulated loop at every batch "
            f"(simulated T4): {all(r.within for r in rows)}")


def largest_batch(rows: list[BudgetCheck]) -> int:
    """The largest batch that fits a T4 (the budget's search, at the first row)."""
    return rows[0].budget.largest_batch


def check_table(rows: list[BudgetCheck]) -> str:
    """Budget against simulation, one line per batch, with the verdict of each from TOLERANCE."""
    job = "training step" if rows[0].budget.train else "encoding"
    lines = [f"{rows[0].budget.spec} on a T4 (simulated), {job}, {rows[0].budget.precision}; reserved VRAM "
             f"without the CUDA context",
             f"  {'batch':>7} {'budget':>10} {'simulated':>10} {'budget/sim':>10}  within {TOLERANCE:.0%}"]
    for r in rows:
        lines.append(f"  {r.batch:>7,} {r.budget.reserved / 1e9:>8.3f} GB {r.simulated.max_reserved / 1e9:>7.3f} GB "
                     f"{r.ratio:>10.3f}  {'yes' if r.within else 'NO'}")
    largest = largest_batch(rows)
    ceiling = " (the search's ceiling: more may fit)" if largest == SEARCH_CEILING else ""
    lines.append(f"  largest batch whose budget fits {1 - FIT_MARGIN:.0%} of the T4: {largest:,}{ceiling}")
    return "\n".join(lines)


@dataclass(frozen=True)
class KillResume:
    """A CLI encode SIGKILLed mid-run and rerun, against an unkilled run of the same command."""

    parts_total: int
    durable_at_kill: int            # samples the manifest listed as durable when the kill landed
    n_samples: int
    identical: dict                 # output -> its consolidated .npy, byte for byte, equals the unkilled run's

    def lines(self) -> str:
        out = [f"SIGKILL after parts were durable: the manifest listed {self.durable_at_kill:,} of "
               f"{self.n_samples:,} samples; the rerun encoded the rest"]
        out += [f"  {name:<18} resumed == unkilled, byte for byte: {same}" for name, same in self.identical.items()]
        return "\n".join(out)


def kill_and_resume(cache_dir: str | Path, folder: str | Path, spec: str, profile: str, batch_size: int, *,
                    after_parts: int = 3, progress: bool = True) -> KillResume:
    """An unkilled run (`encode` in this process), then `python -m nblib encode --model SPEC` with the same
    profile, batch and one batch per part, SIGKILLed once `after_parts` parts exist and run again; the
    consolidated outputs of the two compared byte for byte. The command inherits this process's environment
    (the same threads: the same bytes; `nblib.encode.run`'s determinism).
    """
    import shutil
    import subprocess

    from nblib.cache import ShardedImageCache
    from nblib.encode import encode, load_outputs

    folder = Path(folder)
    shutil.rmtree(folder, ignore_errors=True)
    whole, killed = folder / "unkilled", folder / "killed"
    config = for_profile(profile).replace(batch_size=batch_size, checkpoint_every=1, consolidate_every=1)
    command = encode_command(cache_dir, killed, model=spec, profile=profile, batch_size=batch_size,
                             checkpoint_every=1, no_progress=True)       # the same config, from the command line
    with progress_bar(3, "unkilled run, killed run, rerun", "run", disable=not progress) as bar:
        encode(ShardedImageCache(cache_dir), whole, config, model=spec, progress=False)
        bar.update(1)
        durable = run_and_kill(command, killed, after_parts=after_parts)
        bar.update(1)
        subprocess.run(command, check=True, capture_output=True)
        bar.update(1)
    outputs = load_outputs(whole)
    same = {name: (whole / f"{name}.npy").read_bytes() == (killed / f"{name}.npy").read_bytes() for name in outputs}
    n = len(next(iter(outputs.values())))
    return KillResume(-(-n // batch_size), durable, n, same)


def train_command(cache_dir: str | Path, out: str | Path, spec: str, config, mirror: str | Path | None = None) -> str:
    """The `python -m nblib train` line running what `train(cache_dir, out, config, model=spec, mirror=mirror)` runs."""
    from nblib.proc import cli_command

    return "python " + " ".join(cli_command(
        "train", cache=cache_dir, out=out, model=spec, mirror=mirror, steps=config.steps,
        batch_size=config.batch_size, save_every=config.save_every, backup_every=config.backup_every,
        eval_every=config.eval_every, profile=config.profile)[1:])


def t4_time(spec: str, image_size: int, n_samples: int, precision: str = "fp16") -> str:
    """The T4 projection (`nblib.t4_speed`) of encoding `n_samples` images with `spec` (FLOPs counted on a CPU):
    its rate range, then the time range in the unit that reads (a tiny model takes seconds, not hours).
    """
    from nblib.models import load_model
    from nblib.t4_speed import model_projection

    p = model_projection(load_model(spec), image_size, precision, n_samples=n_samples)
    return (f"{spec} on a T4, {precision} ({p.label}): {p.flops_per_sample / 1e9:.3f} GFLOP per image, "
            f"{p.rate_text()}; {n_samples:,} images in {p.hours_text()} if FLOPs bound the run (a floor "
            f"where the input pipeline or per-batch overheads bound it instead)\n  method: {p.method}")
