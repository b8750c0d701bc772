"""The suite's knob grids and its two sweeps: tf.data over sources, DataLoader over the sharded cache.

Each grid's first value per knob is the base config; the others are tried one at a time
(`nblib.pipeline.sweep`). `device_step` is the stand-in encoder the sweeps feed. Notebook 05 and
`python -m nblib pipeline` sweep through these, so the notebook and the CLI measure one grid.
"""
from __future__ import annotations

import functools

from nblib.compare import MIN_REPEATS
from nblib.pipeline.harness import ComputeStandIn
from nblib.pipeline.sweep import sweep

# the default grids (each knob's first value is the base config; the others are tried one at a time)
TF_GRID = {"batch_size": [32, 8, 128], "num_parallel_calls": [2, 1, 8, -1], "prefetch": [2, 0, 8],
           "cycle_length": [4, 1], "shuffle_buffer": [256, 0, 2048], "deterministic": [True, False]}
# the torch base has 2 workers: prefetch_factor and persistent_workers do nothing without workers
TORCH_GRID = {"num_workers": [2, 0, 1], "batch_size": [32, 128], "prefetch_factor": [2, 4],
              "persistent_workers": [False, True]}
# the smoke profile's grids: every knob still swept, each with the values section 8's findings read (batch 128,
# 8 calls and AUTOTUNE, the 2048 buffer) or else one value beside the base: 6 configs against the base, not 11
TF_GRID_SMALL = {"batch_size": [32, 128], "num_parallel_calls": [2, 8, -1], "prefetch": [2, 0],
                 "cycle_length": [4, 1], "shuffle_buffer": [256, 2048], "deterministic": [True, False]}
TORCH_GRID_SMALL = {"num_workers": [2, 0], "batch_size": [32, 128], "prefetch_factor": [2, 4],
                    "persistent_workers": [False, True]}


def device_step(per_sample_ms: float, launch_ms: float = 1.0) -> ComputeStandIn:
    """The stand-in encoder step: `launch_ms` per batch plus `per_sample_ms` per image, holding no core."""
    return ComputeStandIn(launch_ms, per_sample_ms=per_sample_ms)


def tf_sweep(sources, grid: dict, consumer=None, steps: int = 20, warmup: int = 3, repeats: int = MIN_REPEATS,
             progress: bool = False, budget_s: float | None = None):
    """Sweep tf.data knobs (one at a time around each knob's first value) over `sources`.

    Every config runs `repeats` times, each run next to a run of the base (`pipeline.sweep`); with
    `budget_s`, undecided configs get more pairs while the whole sweep stays within it.
    """
    from nblib.pipeline.tf_pipelines import tf_pipeline_for

    return sweep(tf_pipeline_for(sources), grid, consumer=consumer, steps=steps, warmup=warmup, repeats=repeats,
                 budget_s=budget_s, progress="tf.data sweep" if progress else False)


def torch_sweep(cache, grid: dict, consumer=None, steps: int = 20, warmup: int = 3, repeats: int = MIN_REPEATS,
                progress: bool = False, budget_s: float | None = None):
    """Sweep torch DataLoader knobs over the sharded cache (epoch after epoch), skipping inert knobs (as `tf_sweep`)."""
    from nblib.pipeline.torch_loaders import cache_loader_for

    inert = functools.partial(torch_inert_knob, n_images=len(cache), batches_measured=steps + warmup)
    return sweep(cache_loader_for(cache), grid, consumer=consumer, steps=steps, warmup=warmup, repeats=repeats,
                 inert=inert, budget_s=budget_s, progress="DataLoader sweep" if progress else False)


def torch_inert_knob(knob: str, config: dict, n_images: int, batches_measured: int) -> str | None:
    """Why `knob` does nothing in `config` (None when it acts): a knob that does nothing is not swept.

    `prefetch_factor` and `persistent_workers` only exist for worker processes; `persistent_workers`
    only saves the respawn at an epoch's end, so a measurement within one epoch cannot see it.
    """
    workers = config.get("num_workers", 0)
    if knob in ("prefetch_factor", "persistent_workers") and workers == 0:
        return "it does nothing at num_workers=0 (torch ignores it without worker processes)"
    if knob == "persistent_workers":
        per_epoch = -(-n_images // max(1, config.get("batch_size", 1)))
        if batches_measured <= per_epoch:
            return (f"the {batches_measured} batches measured stay within one epoch of {per_epoch}, "
                    f"so no worker is ever respawned")
    return None

