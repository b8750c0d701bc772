"""Notebook 05's experiments: knob sweeps, the mixing slowdown and its fix, the per-worker TF trap,
streaming vs loading the cache, and the "what moved the needle" table against the tuning log.

Each function runs one experiment with real tf.data / DataLoader pipelines and returns plain
rows; verdicts compare those rows with `nblib.reference.TUNING_LOG` by the paired method of
`nblib.verdict` (speed against the base in interleaved pairs, memory against the noise of RSS), so a
finding agrees or not because of what was measured here, never because it was typed.
"""
from __future__ import annotations

import functools
import json
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from nblib import t4_speed
from nblib.compare import MIN_REPEATS, Spread, compare, interleaved, progress_bar
from nblib.env import usable_cores
from nblib.pipeline import measure_pipeline
from nblib.pipeline.grids import (  # noqa: F401  notebook 05 reads the grids and sweeps as lab.*
    TF_GRID,
    TF_GRID_SMALL,
    TORCH_GRID,
    TORCH_GRID_SMALL,
    device_step,
    tf_sweep,
    torch_inert_knob,
    torch_sweep,
)
from nblib.pipeline.recommend import knob_verdicts, most_effective_knob, value_verdicts
from nblib.reference import TUNING_LOG
from nblib.units import fmt_bytes, fmt_duration, fmt_rate
from nblib.verdict import (
    MIN_EFFECT,
    MemoryVerdict,
    PairedVerdict,
    memory_verdict,
    verdict_of_pairs,
    verdict_of_runs,
)

# what "agrees" means for each finding of the tuning log (the reference's own numbers are in TUNING_LOG)
DOMINATES_SHARE = 0.5        # "the pipeline dominated": data-wait at least half the step
# "helped", "was slower", "mixing cost throughput": a firm paired verdict against the base (or one
# source), nblib.verdict: a 95% interval of the median pair ratio wholly beyond MIN_EFFECT (1.15x) either way
PER_WORKER_BYTES = 100e6     # "each worker builds its own TF": >= 100 MB more per worker
FIX_RECOVERS = 0.80          # the mixing fix must recover >= 80% of single-source samples/s


cores = usable_cores     # CPU cores this process may use: the parallelism budget of this machine (lab.cores())


def tf_sources(cache, n_images: int | None = None, n_sources: int = 4):
    """The cache's first `n_images` as PNG bytes in RAM, cut into `n_sources` sources (tf.data's input)."""
    from nblib.pipeline.tf_pipelines import encoded_sources

    n = len(cache) if n_images is None else min(n_images, len(cache))
    return encoded_sources((cache[i] for i in range(n)), n_sources)


def stand_in_encoder() -> tuple[float, str]:
    """The stand-in encoder's rate and the line that says where it comes from.

    The fast end of the T4's sourced range for seed_t4 in fp16 (nblib.t4_speed, a projection): a pipeline
    that keeps up with the fast end keeps up with the whole range.
    """
    p = t4_speed.seed_t4("fp16")
    rate = p.samples_per_s.high
    return rate, (f"stand-in encoder: {rate:,.0f} samples/s = {fmt_duration(1 / rate)} per image, the fast end of "
                  f"the T4's {p.rate_text()} for seed_t4 in {p.precision} ({p.label}, nblib.t4_speed: "
                  f"public T4 measurements with their sources)")


def where_time_goes(sources, encoder_samples_per_s: float | None = None, batch_size: int = 32,
                    steps: int = 8, repeats: int = MIN_REPEATS, progress: bool = False) -> dict:
    """The default tf.data pipeline feeding a stand-in encoder (`stand_in_encoder()`): data-wait is its share.

    Both measurements (fed to the encoder, and the pipeline alone) run `repeats` interleaved times (`progress`:
    the suite's bar over them); the row holds the median run and every run's data-wait and pipeline rate.
    """
    from nblib.pipeline.tf_pipelines import tf_pipeline

    encoder_samples_per_s = encoder_samples_per_s or stand_in_encoder()[0]
    step = device_step(1e3 / encoder_samples_per_s, launch_ms=0.0)
    reports: dict[str, list] = {"fed": [], "alone": []}

    def fed() -> float:
        reports["fed"].append(measure_pipeline(lambda: tf_pipeline(sources, batch_size=batch_size), consumer=step,
                                               steps=steps, warmup=2))
        return reports["fed"][-1].data_wait

    def alone() -> float:
        reports["alone"].append(measure_pipeline(lambda: tf_pipeline(sources, batch_size=batch_size),
                                                 steps=3 * steps, warmup=3))
        return reports["alone"][-1].samples_per_s

    got = interleaved({"fed": fed, "alone": alone}, repeats, progress=progress and "fed, alone")
    median_fed = sorted(reports["fed"], key=lambda r: r.data_wait)[(len(reports["fed"]) - 1) // 2]
    return {"encoder_samples_per_s": encoder_samples_per_s, "pipeline_samples_per_s": got["alone"].median,
            "pipeline_runs": got["alone"].values, "data_wait_runs": got["fed"].values, **median_fed.as_dict()}


def time_share_verdict(share: dict) -> str:
    """Who is the wall, computed from every run: the pipeline (data-wait >= DOMINATES_SHARE) or the encoder.

    The encoder is the wall when data-wait stays under DOMINATES_SHARE in every run and the pipeline alone
    is faster than the encoder by `verdict_of_runs` (its runs against the encoder's rate).
    """
    waits = Spread(tuple(share.get("data_wait_runs", (share["data_wait"],))))
    alone = Spread(tuple(share.get("pipeline_runs", (share["pipeline_samples_per_s"],))))
    encoder = share["encoder_samples_per_s"]
    versus = _alone_vs_encoder(share)      # the pipeline alone against the encoder's rate
    numbers = (f"data-wait {waits.low:.1%}-{waits.high:.1%} of each step over {waits.n} runs; the pipeline alone "
               f"{alone.text(unit='samples/s')} against the encoder's {encoder:,.0f}: "
               f"{versus.short('faster', 'slower')}")
    if waits.n < MIN_REPEATS:
        return f"too few runs for a verdict: {numbers}"
    if waits.high < DOMINATES_SHARE and versus.direction == "higher":
        return f"the encoder is the wall, in every run: {numbers}"
    if waits.low >= DOMINATES_SHARE:
        return f"the input pipeline is the wall, in every run: {numbers}"
    return f"not distinguishable on this machine: {numbers}"


def sweep_verdict(table) -> str:
    """The sweep's conclusion from paired runs: each knob value against the base, and the knob that mattered."""
    values = value_verdicts(table)
    verdicts = knob_verdicts(table)
    mattered = most_effective_knob(verdicts)
    counts = sorted({v.n for vs in values.values() for v in vs}) or [0]
    pairs = f"{counts[0]}" if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    lines = [f"  {v.b:<24} {v.short('faster', 'slower')}" for vs in values.values() for v in vs]
    head = (f"{mattered} mattered most: {verdicts[mattered].b} vs the base, "
            f"{verdicts[mattered].short('faster', 'slower')}" if mattered else
            "no knob's effect stood out of the noise on this machine: no knob value is faster or slower than "
            "the base beyond the noise")
    return "\n".join([head, f"each knob value against the base ({pairs} pairs, each next to a base run; a call "
                             f"needs the whole 95% interval beyond x{MIN_EFFECT:.2f} either way):", *lines])


# ------------------------------------------------------------------------------ mixing


@dataclass(frozen=True)
class MixingResult:
    """samples/s of one dataset, of 4 sources mixed by sample_from_datasets, and of the fix, measured together."""

    budget: int                 # total num_parallel_calls; the mixed pipeline gives each source budget // 4
    single: float
    mixed: float
    fixed: float
    repeats: int
    runs: dict = field(default_factory=dict)   # "single" | "mixed" | "fixed" -> every run's samples/s

    def spread(self, which: str) -> Spread:
        """Every run of "single", "mixed" or "fixed" (one value, the median, when runs were not kept)."""
        return Spread(tuple(self.runs.get(which, (getattr(self, which),))))

    @property
    def mixing(self) -> PairedVerdict:
        """Mixed against one dataset, on the rounds' pairs: its ratio is the share of the speed kept (x0.72)."""
        return compare(self.spread("single"), self.spread("mixed"), ("one dataset", "mixed"))

    @property
    def fix(self) -> PairedVerdict:
        """The fix against one dataset, on the rounds' pairs: the verdict's ratio is the share recovered."""
        return compare(self.spread("single"), self.spread("fixed"), ("one dataset", "the fix"))

    @property
    def fix_works(self) -> bool:
        """The fix recovers >= FIX_RECOVERS of one dataset: its verdict's whole 95% interval is at or above it."""
        return self.fix.enough_runs and self.fix.low >= FIX_RECOVERS

    def recovery_text(self) -> str:
        """Whether the fix recovers FIX_RECOVERS of one dataset, judged on the interval the fix's line prints."""
        fix, floor = self.fix, f"x{FIX_RECOVERS:.2f}"
        if self.fix_works:
            return f"recovers >= {FIX_RECOVERS:.0%} of one dataset: the whole interval is at or above {floor}"
        if fix.enough_runs and fix.high < FIX_RECOVERS:
            return f"recovers < {FIX_RECOVERS:.0%} of one dataset: the whole interval is below {floor}"
        return (f"recovering {FIX_RECOVERS:.0%} of one dataset is not shown: the interval "
                f"{fix.low:.2f}-{fix.high:.2f} reaches below {floor}" if fix.enough_runs else fix.reason)

    def table(self) -> str:
        mixed, single = TUNING_LOG["rate mixing 4 datasets"].value
        names = ("one dataset", "4 sources, sample_from_datasets", "4 sources, fix: interleave records, then decode")
        lines = [f"parallelism budget {self.budget} (sample_from_datasets: {max(1, self.budget // 4)} per source), "
                 f"{self.spread('single').n} interleaved rounds; samples/s, median (min-max):"]
        for name, key in zip(names, ("single", "mixed", "fixed")):
            got = self.spread(key)
            lines.append(f"  {name:<48} {fmt_rate(got.median):>18} ({got.low:,.0f}-{got.high:,.0f})")
        lines += [f"  mixing: {self.mixing.text('faster', 'slower')}",
                  f"  fix:    {self.fix.text('faster', 'slower')}; {self.recovery_text()}",
                  f"  reference: {mixed} vs {single} samples/s mixing 4 vs one: x{mixed / single:.2f}"]
        return "\n".join(lines)


def mixing_experiment(sources, budget: int | None = None, repeats: int = MIN_REPEATS, steps: int = 30,
                      warmup: int = 3, batch_size: int = 32, progress: bool = False,
                      budget_s: float | None = None) -> MixingResult:
    """Measure one source, 4 mixed with sample_from_datasets, and the fix, interleaved `repeats` times.

    With `budget_s`, more rounds run while either verdict against one source is undecided (`interleaved`).
    """
    from nblib.pipeline.tf_pipelines import mixed_pipeline

    budget = budget or cores()
    def run(strategy: str) -> float:
        make = functools.partial(mixed_pipeline, sources, strategy, num_parallel_calls=budget, batch_size=batch_size)
        return measure_pipeline(make, steps=steps, warmup=warmup).samples_per_s

    got = interleaved({k: functools.partial(run, k) for k in ("single", "sample_from_datasets", "interleave")},
                      repeats, progress="mixing" if progress else False, budget_s=budget_s,
                      decide=(("single", "sample_from_datasets"), ("single", "interleave")))
    spreads = dict(zip(("single", "mixed", "fixed"), got.values()))
    return MixingResult(budget=budget, single=spreads["single"].median, mixed=spreads["mixed"].median,
                        fixed=spreads["fixed"].median, repeats=spreads["single"].n,
                        runs={k: v.values for k, v in spreads.items()})


# ------------------------------------------------------------------------------ the per-worker TF trap


def tf_worker_trap(sources, worker_counts=(0, 1, 2), batch_size: int = 32, batches: int = 12,
                   progress: bool = False) -> list[dict]:
    """Peak RAM when every torch worker builds its own tf.data pipeline, per num_workers (`progress`: the
    suite's bar, one step per worker count). At 0 workers the one pipeline runs in this process and feeds
    torch's DataLoader: the first remedy, measured once.
    """
    from nblib.pipeline.tf_pipelines import tf_pipeline
    from nblib.pipeline.torch_loaders import repeated, tf_in_workers_loader

    build = functools.partial(tf_pipeline, sources, batch_size=batch_size)
    rows = []
    with progress_bar(len(worker_counts), "TF in workers", "setup", disable=not progress) as bar:
        for workers in worker_counts:
            per_worker = batches if workers == 0 else -(-batches // workers)
            make = functools.partial(lambda w, n: repeated(tf_in_workers_loader(build, w, n), 1), workers, per_worker)
            report = measure_pipeline(make, steps=max(1, batches - 2), warmup=2)
            rows.append({"setup": f"TF in each of {workers} worker{'s' * (workers > 1)}" if workers else
                         "one TF pipeline in this process feeding torch", "num_workers": workers, **report.as_dict()})
            bar.update(1)
    return rows


def native_remedy(cache, num_workers: int = 2, batch_size: int = 32, steps: int = 20,
                  progress: bool = False) -> list[dict]:
    """The second way out, measured: torch-native workers over the sharded cache (the first, one TF pipeline
    feeding torch, is `tf_worker_trap`'s row at 0 workers).
    """
    from nblib.pipeline.torch_loaders import cache_loader, repeated

    with progress_bar(1, "remedy", "setup", disable=not progress) as bar:
        native = measure_pipeline(lambda: repeated(cache_loader(cache, batch_size, num_workers)), steps=steps,
                                  warmup=3)
        bar.update(1)
    return [{"setup": f"torch workers over the sharded cache ({num_workers})", "num_workers": num_workers,
             **native.as_dict()}]


def trap_table(rows: list[dict]) -> str:
    """The trap and its remedies as text: setup, samples/s, RAM added, peak RAM."""
    lines = [f"{'setup':<44} {'samples/s':>10} {'RAM added':>11} {'peak RAM':>10}"]
    lines += [f"{r['setup']:<44} {r['samples_per_s']:>10,.0f} {fmt_bytes(r['rss_added_bytes']):>11} "
              f"{fmt_bytes(r['peak_rss_bytes']):>10}" for r in rows]
    return "\n".join(lines)


def ram_per_worker(rows: list[dict]) -> float:
    """Bytes each extra TF-in-worker adds: the slope of RAM added against num_workers (least squares)."""
    xs = [r["num_workers"] for r in rows]
    if len(set(xs)) < 2:
        return 0.0
    return float(statistics.linear_regression(xs, [r["rss_added_bytes"] for r in rows]).slope)


# ------------------------------------------------------------------------------ one shard at a time


def streaming_vs_load_all(cache_dir: str | Path) -> dict:
    """Peak RSS added by streaming the cache shard by shard vs loading it all, each in a fresh process."""
    from nblib.cache import ShardedImageCache

    cache = ShardedImageCache(cache_dir)
    result = {"images": len(cache), "cache_bytes": sum(s["bytes"] for s in cache.manifest["shards"]),
              "largest_shard_bytes": max(s["bytes"] for s in cache.manifest["shards"])}
    for mode in ("stream", "load_all"):
        out = subprocess.run([sys.executable, "-m", "nblib.lab.input_pipeline", mode, str(cache_dir)],
                             capture_output=True, text=True, check=True)
        result[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def streaming_table(results: dict[str, dict]) -> str:
    """One line per cache size: its bytes, its largest shard, the RAM each way of reading adds, and each in its own
    unit (streaming's in shards, loading's in whole caches).
    """
    lines = [f"{'cache':<8} {'images':>8} {'on disk':>10} {'1 shard':>10} {'stream +RAM':>12} {'load all +RAM':>14} "
             f"{'stream, shards':>15} {'load all, caches':>17}"]
    for name, r in results.items():
        stream, load_all = r["stream"]["rss_added"], r["load_all"]["rss_added"]
        lines.append(f"{name:<8} {r['images']:>8,} {fmt_bytes(r['cache_bytes']):>10} "
                     f"{fmt_bytes(r['largest_shard_bytes']):>10} {fmt_bytes(stream):>12} {fmt_bytes(load_all):>14} "
                     f"{stream / r['largest_shard_bytes']:>15.1f} {load_all / r['cache_bytes']:>17.2f}")
    return "\n".join(lines)


def _read_cache(mode: str, cache_dir: str) -> dict:
    """In a fresh process: read every image of a cache shard by shard ("stream") or all at once."""
    from nblib.cache import ShardedImageCache
    from nblib.measure import PeakMemory

    cache = ShardedImageCache(cache_dir)
    with PeakMemory() as memory:
        if mode == "stream":
            total = sum(int(shard[:, 0, 0, 0].sum()) for shard in cache.iter_shards())
        else:
            everything = cache.get_batch(0, len(cache))
            total = int(everything[:, 0, 0, 0].sum())
    return {"rss_added": memory.delta, "checksum": total}


# ------------------------------------------------------------------------------ render on the fly


def render_vs_cache(cache, texts=None, num_workers: int | None = None, batch_size: int = 32,
                    steps: int = 12, repeats: int = MIN_REPEATS, progress: bool = False) -> list[dict]:
    """samples/s of the DataLoader reading the cache vs rendering the same images (from `texts`) in its
    workers, at the cache's image size: `repeats` interleaved runs each (rows keep every run; `progress`: a bar).
    """
    from nblib.cache.rendered import RenderedImages
    from nblib.pipeline.torch_loaders import cache_loader, repeated

    workers = cores() if num_workers is None else num_workers
    rendered = RenderedImages.like(cache, texts)
    reports: dict[str, list] = {}
    size = cache.shape[0]

    def run(name: str, source) -> float:
        report = measure_pipeline(lambda: repeated(cache_loader(source, batch_size, workers)), steps=steps, warmup=2)
        reports.setdefault(name, []).append(report)
        return report.samples_per_s

    sources = {f"cache reader ({size} px)": cache, f"render on the fly ({size} px, {workers} workers)": rendered}
    got = interleaved({name: functools.partial(run, name, src) for name, src in sources.items()}, repeats,
                      progress=progress and "cache reader, render")
    rows = []
    for name, spread_ in got.items():
        median_run = sorted(reports[name], key=lambda r: r.samples_per_s)[(len(reports[name]) - 1) // 2]
        rows.append({"source": name, **median_run.as_dict(), "runs": spread_.values})
    return rows


def render_loader_rate(texts, image_size: int = 224, num_workers: int | None = None, batch_size: int = 32,
                       steps: int = 6, repeats: int = MIN_REPEATS, progress: bool = False) -> Spread:
    """samples/s of a DataLoader whose workers render `texts` at `image_size`, `repeats` runs (`progress`: a bar).

    Measured, not extrapolated from one core: what the workers really give on this machine's cores.
    """
    from nblib.cache.rendered import RenderedImages
    from nblib.pipeline.torch_loaders import cache_loader, repeated

    workers = cores() if num_workers is None else num_workers
    rendered = RenderedImages(list(texts), image_size)

    def run() -> float:
        return measure_pipeline(lambda: repeated(cache_loader(rendered, batch_size, workers)),
                                steps=steps, warmup=2).samples_per_s

    return interleaved({"render": run}, repeats, progress=progress and f"render at {image_size} px")["render"]


def encoder_projection(budget) -> tuple[float, str]:
    """The encoder's images/s a loader must beat, from a Budget, and how it was made (a projection, its method).

    On a T4 the fast end of nblib.t4_speed's sourced range (a loader that beats it beats the whole
    range); elsewhere the budget's one projected rate.
    """
    size = budget.config.model.image_size
    if budget.speed:
        return budget.speed.samples_per_s.high, (
            f"the fast end of the {budget.device.name.upper()}'s {budget.rate_text()} for "
            f"{budget.flops_per_image / 1e9:,.1f} GFLOP per {size} px image, {budget.speed.precision}: "
            f"{budget.speed.label}, nblib.t4_speed, public T4 measurements with their sources")
    return budget.samples_per_s, f"{budget.speed_method}, {size} px"


def cacheless_verdict(rendered: Spread, encoder_samples_per_s: float, encoder_method: str, image_size: int,
                      workers: int | None = None) -> str:
    """Does rendering in the loader's workers keep up with the encoder? Both at `image_size`.

    `verdict_of_runs`: each run's rate over the encoder's, their median and its 95% interval. "keeps up"
    only when the whole interval lies beyond the minimum effect (a margin, not a median
    that touches the rate), "starves" the same way below, otherwise no verdict. The line prints what it judged.
    """
    workers = cores() if workers is None else workers
    v = verdict_of_runs(rendered.values, encoder_samples_per_s, ("the encoder", "rendering"))
    head = (f"at {image_size} px, {workers} loader workers render {rendered.text(unit='images/s')} on this "
            f"machine; the encoder takes {fmt_rate(encoder_samples_per_s)} ({encoder_method})")
    judged = f"rendered / encoder {v.short('faster', 'slower')}"
    if v.direction == "higher":
        return f"{head}: rendering keeps up ({judged}), so the image cache is not needed here"
    if v.direction == "lower":
        return f"{head}: rendering would starve the encoder ({judged}): keep the cache"
    return (f"{head}: not distinguishable on this machine: rendered / encoder {v.head}; {v.reason}; measure on the "
            f"machine that will run the job")


def rates_table(rows: list[dict]) -> str:
    """Sources side by side: samples/s (median and range of the runs), startup, RAM added, and the verdict."""
    lines = [f"{'source':<42} {'samples/s':>10} {'range':>13} {'startup':>8} {'RAM added':>10}"]
    spreads = [Spread(tuple(r.get("runs", (r["samples_per_s"],)))) for r in rows]
    for r, got in zip(rows, spreads):
        lines.append(f"{r['source']:<42} {got.median:>10,.0f} {f'{got.low:,.0f}-{got.high:,.0f}':>13} "
                     f"{fmt_duration(r['startup_s']):>8} {fmt_bytes(r['rss_added_bytes']):>10}")
    if len(rows) == 2:
        lines.append(compare(*spreads, (rows[0]["source"], rows[1]["source"])).text("faster", "slower"))
    return "\n".join(lines)


# ------------------------------------------------------------------------------ what moved the needle


def needle_table(time_share: dict, tf_table, mixing: MixingResult, trap_rows: list[dict],
                 ncores: int | None = None) -> list[dict]:
    """The tuning log's findings beside this machine's measurements, each with a computed verdict.

    `time_share` is `where_time_goes`'s row, the other arguments the sweeps and experiments.
    """
    ncores = ncores or cores()
    rows = [_dominates(time_share), _batch_helped(tf_table), _more_parallel_slower(tf_table, ncores),
            _autotune_slower(tf_table), *_buffers_cost(tf_table), _mixing_slower(mixing),
            _worker_trap(trap_rows)]
    return [r for r in rows if r is not None]


def needle_text(rows: list[dict]) -> str:
    """The needle table as text: finding, reference, here, verdict, and why where it differs."""
    lines = []
    for r in rows:
        lines += [f"{r['finding']}: {r['verdict'].upper()}",
                  f"    reference     {r['reference']}", f"    this machine  {r['measured']}"]
        if "basis" in r:
            lines.append(f"    judged on     {r['basis']}")
        if r["verdict"] != "agrees":
            lines.append(f"    why           {r['why']}")
    return "\n".join(lines)


NOT_DISTINGUISHABLE = "not distinguishable on this machine"


def _finding(finding: str, reference: str, measured: str, agrees: bool, why: str,
             versus=None) -> dict:
    """A finding's row; with `versus` (a paired verdict), a verdict that is not firm gives none, and says why."""
    if versus is not None and not versus.distinguishable:
        text = versus.short() if isinstance(versus, MemoryVerdict) else versus.short("faster", "slower")
        return {"finding": finding, "reference": reference,
                "measured": measured if text in measured else f"{measured} ({text})",
                "verdict": NOT_DISTINGUISHABLE, "why": versus.reason}
    return {"finding": finding, "reference": reference, "measured": measured,
            "verdict": "agrees" if agrees else "does not", "why": why}


def _dominates(time_share: dict) -> dict:
    low, high = TUNING_LOG["input pipeline share of step time"].value
    share, encoder, pipeline = (time_share[k] for k in ("data_wait", "encoder_samples_per_s", "pipeline_samples_per_s"))
    waits = Spread(tuple(time_share.get("data_wait_runs", (share,))))
    if waits.low < DOMINATES_SHARE <= waits.high:
        return {"finding": "the pipeline dominated the step", "reference": f"{low:.0%}-{high:.0%} of step time",
                "measured": f"{waits.low:.0%}-{waits.high:.0%} over {waits.n} runs", "verdict": NOT_DISTINGUISHABLE,
                "why": "the runs fall on both sides of half the step"}
    return _finding("the pipeline dominated the step", f"{low:.0%}-{high:.0%} of step time",
                    f"{share:.0%} feeding a {encoder:,.0f}/s encoder", share >= DOMINATES_SHARE,
                    f"rendered-text PNGs decode at {pipeline:,.0f} samples/s, against the encoder's rate "
                    f"{_alone_vs_encoder(time_share).head}: for this job the encoder is the wall")


def _alone_vs_encoder(time_share: dict) -> PairedVerdict:
    """The pipeline alone against the encoder's rate, its runs judged by `verdict_of_runs`."""
    runs = time_share.get("pipeline_runs", (time_share["pipeline_samples_per_s"],))
    return verdict_of_runs(runs, time_share["encoder_samples_per_s"], ("the encoder", "the pipeline alone"))


def _against_base(table, knob: str, pick) -> tuple[dict, object] | None:
    """The row of `knob`'s curve chosen by `pick` (not the base) and its paired verdict against the base."""
    base = table.base
    rows = [r for r in table.curve(knob) if r is not base] if knob in table.knobs else []
    row = pick(rows) if rows else None
    return None if row is None else (row, table.versus_base(row))


def _batch_helped(table) -> dict | None:
    got = _against_base(table, "batch_size", lambda rows: max(rows, key=lambda r: r["batch_size"]))
    if got is None or got[0]["batch_size"] < table.base["batch_size"]:
        return None
    row, v = got
    ref = TUNING_LOG["rate at batch 128"].value / TUNING_LOG["rate at batch 24"].value
    return _finding("larger batches helped", f"24->128: x{ref:.1f}",
                    f"{table.base['batch_size']}->{row['batch_size']}: {v.short('faster', 'slower')}",
                    v.direction == "higher", "per-batch overheads are already small next to per-image decode here", v)


def _more_parallel_slower(table, ncores: int) -> dict | None:
    if "num_parallel_calls" not in table.knobs or not 0 < table.base["num_parallel_calls"] <= ncores:
        return None
    got = _against_base(table, "num_parallel_calls",
                        lambda rows: max((r for r in rows if r["num_parallel_calls"] > ncores),
                                         key=lambda r: r["num_parallel_calls"], default=None))
    if got is None:
        return None
    row, v = got
    return _finding("more num_parallel_* was slower", "128/64 calls: slower",
                    f"{row['num_parallel_calls']} calls vs the base's {table.base['num_parallel_calls']} "
                    f"(<= {ncores} cores): {v.short('faster', 'slower')}", v.direction == "lower",
                    f"{row['num_parallel_calls']} threads on {ncores} cores queue rather than contend; the "
                    f"reference ran 64-128 threads", v)


def _autotune_slower(table) -> dict | None:
    if "num_parallel_calls" not in table.knobs or table.base["num_parallel_calls"] <= 0:
        return None
    got = _against_base(table, "num_parallel_calls",
                        lambda rows: next((r for r in rows if r["num_parallel_calls"] == -1), None))
    if got is None:
        return None
    row, v = got
    return _finding("AUTOTUNE was slower than fixed", "AUTOTUNE: slower",
                    f"AUTOTUNE vs the base's fixed {table.base['num_parallel_calls']}: {v.short('faster', 'slower')}",
                    v.direction == "lower", "with 2 cores AUTOTUNE has little to choose between", v)


def _buffers_cost(table) -> list[dict]:
    """Two findings of the largest shuffle buffer against the base: more RAM (the log's), and a later start."""
    got = _against_base(table, "shuffle_buffer", lambda rows: max(rows, key=lambda r: r["shuffle_buffer"]))
    if got is None or got[0]["shuffle_buffer"] <= table.base["shuffle_buffer"] or "base_rss_runs" not in got[0]:
        return []
    row, _ = got
    base = table.base
    low, high = TUNING_LOG["RSS with larger shuffle buffers"].value
    names = (f"shuffle_buffer={base['shuffle_buffer']}", f"shuffle_buffer={row['shuffle_buffer']}")
    memory = memory_verdict(row["base_rss_runs"], row["rss_runs"], names)
    start = verdict_of_pairs(row["base_startup_runs"], row["startup_runs"], names)
    return [_finding("larger shuffle buffers: more RAM", f"RSS {fmt_bytes(low)} -> {fmt_bytes(high)}",
                     f"peak RSS {memory.short()}", memory.direction == "more",
                     "the buffers swept here are too small next to the process's RSS to stand out", memory),
            _finding("larger shuffle buffers: later start", "later start (the log gives no figure)",
                     f"start {start.short('later', 'earlier')}", start.direction == "higher",
                     "the buffers swept here fill in less time than the rest of the start-up", start)]


def _mixing_slower(mixing: MixingResult) -> dict:
    low, high = TUNING_LOG["rate mixing 4 datasets"].value
    v = mixing.mixing
    return _finding("mixing 4 datasets was slower", f"{low} vs {high} samples/s: x{low / high:.2f}",
                    f"mixed vs one dataset {v.short('faster', 'slower')}", v.direction == "lower",
                    f"with a budget of {mixing.budget}, each source keeps one decode thread, and "
                    f"{mixing.budget} cores stay busy either way", v)


def _worker_trap(rows: list[dict]) -> dict | None:
    """The log's per-worker RAM, judged on its direction: each TF-in-worker adds >= PER_WORKER_BYTES.

    The size is not judged (the reference's pipelines held GB-sized shuffle buffers, these a few MB):
    both figures are printed, and their ratio, beside the basis of the verdict.
    """
    if len(rows) < 2:
        return None
    slope = ram_per_worker(rows)
    ref = TUNING_LOG["RAM per torch worker"].value
    row = _finding("TF in each torch worker costs RAM", f"~{fmt_bytes(ref)} per worker",
                   f"{fmt_bytes(slope)} per worker (x{slope / ref:.2f} the reference's)", slope >= PER_WORKER_BYTES,
                   f"{fmt_bytes(slope)} per worker is under {fmt_bytes(PER_WORKER_BYTES)}: the workers' pipelines "
                   f"hold little here")
    row["basis"] = (f"the direction, not the size: each worker adds at least {fmt_bytes(PER_WORKER_BYTES)} "
                    f"(its own TF runtime)")
    return row


if __name__ == "__main__":
    print(json.dumps(_read_cache(sys.argv[1], sys.argv[2])))
