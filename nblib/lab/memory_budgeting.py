"""Notebook 01's experiment: the reference analysis figure by figure against the budget, and its tables.

Each reference figure (nblib.reference.ANALYSIS) is set beside the budget's own figure for the
same quantity; the verdict is computed: "right" when the two agree within `tolerance`
(default 10%), "wrong" otherwise. The reasons say where a gap comes from, with the numbers.
"""
from __future__ import annotations

from dataclasses import dataclass

from nblib import budget
from nblib.reference import ANALYSIS
from nblib.units import GB, MB, fmt_bytes
from nblib.verdict import TOLERANCE, within_tolerance
from nblib.verdict import verdict as verdict_word


@dataclass(frozen=True)
class ReferenceCheck:
    """One figure of the reference analysis beside the budget's figure for the same quantity."""

    item: str
    reference: float      # the reference's value, in `unit`
    ours: float           # the budget's value, in `unit`
    unit: str             # "B", "params" or "h"
    why: str              # where the two come from, with the numbers
    tolerance: float = TOLERANCE

    @property
    def ratio(self) -> float:
        """reference / ours."""
        return self.reference / self.ours

    @property
    def right(self) -> bool:
        """The reference lies within `tolerance` of the budget's figure (nblib.verdict)."""
        return within_tolerance(self.reference, self.ours, self.tolerance)

    @property
    def verdict(self) -> str:
        return verdict_word(self.right)


def reference_comparison(device: str | budget.Device = "t4",
                         tolerance: float = TOLERANCE) -> list[ReferenceCheck]:
    """The reference analysis of seed_t4, figure by figure, against the budget for `device`."""
    from nblib.config import preset

    cfg = preset("seed_t4")
    m, r = cfg.model, cfg.run
    b = budget.predict_budget(cfg, device)
    lines = {line.name: line.bytes for line in (*b.lines["ram"], *budget.model_memory_lines(
        cfg, on_gpu=b.device.is_gpu, sdpa_backend=b.sdpa_backend))}
    n_params = budget.param_count(m)
    heads = m.capsules * m.dim + 3 * m.dim * m.dim + 3 * m.dim + m.children * m.dim * m.dim + m.children * m.dim
    encoder = n_params - heads
    pixels = r.batch_size * m.image_size ** 2 * 3
    math_sdpa = {line.name: line
                 for line in budget.model_memory_lines(cfg, on_gpu=b.device.is_gpu, sdpa_backend="math")}
    per_batch16 = budget.output_bytes_per_batch(cfg.replace(out_dtype="float16"))
    per_batch32 = budget.output_bytes_per_batch(cfg.replace(out_dtype="float32"))
    n_parts = -(-r.n_batches // r.checkpoint_every)
    s_per_batch = ANALYSIS["seconds per batch"].value
    f = fmt_bytes

    def check(item, ref_names, ours, unit, why):
        reference = sum(ANALYSIS[name].value for name in ref_names)
        return ReferenceCheck(item, reference, ours, unit, why, tolerance)

    return [
        check("parameters", ["parameters"], n_params, "params",
              f"patch/position embedding + blocks: {encoder / 1e6:.2f}M; capsule pooling and the children "
              f"head: {heads / 1e6:.2f}M"),
        check("weights fp32", ["weights fp32 (encoder)", "weights fp32 (capsules)"], n_params * 4, "B",
              f"{f(encoder * 4)} encoder + {f(heads * 4)} capsule pooling and children head"),
        check("input images / batch", ["input images per batch"], pixels, "B",
              f"uint8 B x {m.image_size}^2 x 3; the same pixels are {f(pixels * 2)} in fp16, "
              f"{f(pixels * 4)} in fp32"),
        check("patches / batch", ["patches per batch"], pixels * 4, "B", "fp32 patches: B x T x 3p^2 x 4 B"),
        check("attention scores (math)", ["attention scores per batch (math)"],
              math_sdpa["attention scores"].bytes, "B",
              f"the budget's line with sdpa_backend='math': {math_sdpa['attention scores'].why}; flash/efficient: 0"),
        check("activation peak", ["activation peak"], lines["activations at peak"], "B",
              "live buffers in one block's MLP, second H cycle (fp32 residuals, fp16 matmuls)"),
        check("outputs / batch", ["outputs per batch"], per_batch16, "B",
              f"[B,12,768]+[B,12,32]+[B,12,4,768] in fp16; in fp32 {f(per_batch32)}"),
        check("50 batches on GPU", ["outputs held on GPU (50 batches)"], 50 * per_batch16, "B",
              f"50 x {f(per_batch16)} fp16; in fp32 {f(50 * per_batch32)}"),
        check("VRAM total", ["VRAM total"], b.totals["vram"], "B",
              "CUDA context, weights, activations, fp16 outputs on the GPU, allocator cache"),
        check("RAM: 200 batches fp16", ["outputs in RAM (200 batches, fp16)"], 200 * per_batch16, "B",
              f"200 x {f(per_batch16)}; in fp32 {f(200 * per_batch32)}"),
        check("RAM peak (capped)", ["RAM peak (capped)"], b.totals["ram"], "B",
              f"held outputs {f(lines['outputs held until the part'])} + runtime, loader and the part's "
              f"concatenation copy"),
        check("image cache", ["image cache"], budget.cache_bytes(r.n_samples, m.image_size, "raw"), "B",
              f"raw uint8, {m.image_size}^2 x 3 B per image; the reference's size is "
              f"{ANALYSIS['image cache'].value / r.n_samples / 1e3:.0f} KB per image"),
        check("checkpoints", ["checkpoints total"], r.n_samples * budget.output_bytes_per_image(cfg), "B",
              f"{n_parts} parts x {f(r.checkpoint_every * per_batch16)}: each part holds its own batches"),
        check("run time", ["run time"], r.n_batches * s_per_batch / 3600, "h",
              f"{r.n_batches:,} batches x the measured {s_per_batch} s (fp32); in fp16 the budget projects "
              f"{b.rate_text()} ({b.speed.label + ', nblib.t4_speed' if b.speed else b.speed_method}) against the "
              f"measured fp32 {ANALYSIS['samples per second'].value}"),
    ]


def reference_table(device: str | budget.Device = "t4", tolerance: float = TOLERANCE) -> str:
    """reference_comparison as aligned text: item, reference, ours, reference/ours, verdict, why."""
    rows = reference_comparison(device, tolerance)
    cells = [(row.item, show(row.reference, row.unit), show_exact(row.ours, row.unit), f"{row.ratio:.2f}",
              row.verdict, row.why) for row in rows]
    head = ("item", "reference", "ours", "ref/ours", "verdict", "why")
    widths = [max(len(c[i]) for c in [head, *cells]) for i in range(5)]
    return "\n".join("  ".join(c[i].ljust(widths[i]) for i in range(5)) + "  " + c[5] for c in [head, *cells])


def reference_summary(rows: list[ReferenceCheck]) -> str:
    """How many reference figures are off by more than the tolerance, and which."""
    wrong = [row.item for row in rows if not row.right]
    tolerance = rows[0].tolerance if rows else TOLERANCE
    return (f"{len(wrong)} of {len(rows)} figures differ from the budget by more than {tolerance:.0%}: "
            + (", ".join(wrong) if wrong else "none"))


def checkpoint_size_table(rows: list[budget.ShuffleCheckpoint]) -> str:
    """budget.shuffle_checkpoint rows as text: checkpoint, peak disk on a first save and keeping the last."""
    return "\n".join(
        f"buffer {r.buffer_size:>8,}: checkpoint {r.checkpoint_bytes / GB:8.2f} GB, peak disk during save "
        f"{r.peak_disk_first_save / GB:8.2f} GB (first save), {r.peak_disk_keeping_previous / GB:8.2f} GB "
        "(previous kept)" for r in rows)


def shard_table(plans: list[budget.ShardPlan]) -> str:
    """budget.plan_shards results as text: shard count, size and RAM of reading one shard with the next prefetched."""
    return "\n".join(
        f"target {p.target_shard_bytes / MB:>6.0f} MB: {p.n_shards:>5} shards of {p.shard_bytes / MB:7.1f} MB, "
        f"RAM for one shard + one prefetched {p.ram_one_at_a_time / GB:5.2f} GB" for p in plans)


def show(value: float, unit: str) -> str:
    """A quoted figure with three significant digits: '471 MB', '14.9M params', '5.6 h'."""
    if unit == "B":
        size, name = next(((s, n) for n, s in (("GB", GB), ("MB", MB)) if abs(value) >= s), (1, "B"))
        return f"{value / size:.3g} {name}"
    if unit == "params":
        return f"{value / 1e6:.3g}M"
    return f"{value:.3g} {unit}"


def show_exact(value: float, unit: str) -> str:
    """The budget's figure with two decimals: '236.03 MB', '19.06M', '5.63 h'."""
    if unit == "B":
        return fmt_bytes(value)
    if unit == "params":
        return f"{value / 1e6:.2f}M"
    return f"{value:.2f} {unit}"


# ------------------------------------------------------------------------------ measured against predicted


def accuracy_verdict(batch_sizes, predicted, measured, tolerance: float = TOLERANCE, noise: float = 0.0) -> str:
    """The conclusion of 01 §3, computed: is every measured/predicted ratio within `tolerance` of 1?

    `noise` is the RSS noise of the measurement (bytes: the spread of repeated identical runs). A
    batch whose predicted figure is within it, or whose ratio is off but whose gap |measured -
    predicted| is within it, is "too small to see here", neither a hit nor a miss: a figure of a
    few MB on a busy machine cannot confirm or refute a prediction.
    """
    ratios = [m / p for p, m in zip(predicted, measured)]
    unseen = [b for b, p, m, r in zip(batch_sizes, predicted, measured, ratios)
              if p <= noise or (abs(r - 1) > tolerance and abs(m - p) <= noise)]
    seen = [(b, r) for b, r in zip(batch_sizes, ratios) if b not in unseen] or list(zip(batch_sizes, ratios))
    span = (f"measured/predicted {min(r for _, r in seen):.2f}-{max(r for _, r in seen):.2f} over batch sizes "
            f"{', '.join(str(b) for b, _ in seen)}")      # the ratios judged; an unseen batch's ratio is named apart
    outside = [(b, r) for b, r in zip(batch_sizes, ratios) if abs(r - 1) > tolerance and b not in unseen]
    noted = ("; at batch " + ", ".join(f"{b} (x{r:.2f})" for b, r in zip(batch_sizes, ratios) if b in unseen)
             + f" the gap or the figure is within this machine's RSS noise ({fmt_bytes(noise)}): too small to see "
             "here" if unseen else "")
    if len(unseen) == len(ratios):
        return f"too small to see here: every figure or gap is within the RSS noise ({fmt_bytes(noise)}); {span}"
    if not outside:
        return (f"the prediction holds at {len(ratios) - len(unseen)} of {len(ratios)} batch sizes: {span}, every "
                f"ratio seen within {tolerance:.0%} of 1{noted}")
    worst = max(outside, key=lambda br: abs(br[1] - 1))
    return (f"the prediction misses at {len(outside)} of {len(ratios)} batch sizes: {span}; worst x{worst[1]:.2f} "
            f"at batch {worst[0]} (tolerance {tolerance:.0%}){noted}")


@dataclass(frozen=True)
class ForwardPeaks:
    """Predicted and measured peak bytes of one forward pass per batch size, every run kept, and the RSS noise."""

    batch_sizes: tuple[int, ...]
    predicted: tuple[float, ...]
    runs: tuple[tuple[float, ...], ...]     # per batch size, every run's bytes

    @property
    def measured(self) -> list[float]:
        """The median run per batch size."""
        import statistics

        return [float(statistics.median(r)) for r in self.runs]

    @property
    def noise(self) -> float:
        """The RSS noise: the widest spread (max - min) of one batch size's identical runs."""
        return max((max(r) - min(r) for r in self.runs if len(r) > 1), default=0.0)

    def table(self) -> str:
        lines = []
        for b, p, m, r in zip(self.batch_sizes, self.predicted, self.measured, self.runs):
            lines.append(f"batch {b:>5}: predicted {p / 1e6:8.1f} MB   measured {m / 1e6:8.1f} MB "
                         f"({min(r) / 1e6:.1f}-{max(r) / 1e6:.1f}, {len(r)} runs)   ratio {m / p:.2f}")
        lines.append(f"RSS noise (the widest spread of identical runs): {fmt_bytes(self.noise)}")
        return "\n".join(lines)

    def verdict(self, tolerance: float = TOLERANCE) -> str:
        return accuracy_verdict(self.batch_sizes, self.predicted, self.measured, tolerance, self.noise)


# ------------------------------------------------------------------------------ the panel's words


PANEL_KNOBS = ("batch_size", "consolidate_every", "checkpoint_every", "workers", "H_cycles", "L_cycles",
               "n_samples", "out_dtype", "outputs", "codec", "drive_quota_gb", "device")


def panel_verdict(b, knobs=PANEL_KNOBS) -> str:
    """The budget's verdict naming only the knobs a panel has (`knobs`): advice it cannot act on is not shown."""
    if not b.advice:
        return b.headline
    parts = []
    for advice in b.advice:
        kept = [s for s in advice.suggestions if all(k.split(".")[-1] in knobs for k in _knobs_of(s))]
        turns = "; or ".join(map(str, kept)) or "no control of this panel fixes it alone"
        parts.append(f"{advice.text}: " + (f"{advice.note}; {turns}" if advice.note else turns))
    return b.headline + (". " if not b.fits else "; but ") + ". ".join(parts)


def _knobs_of(suggestion) -> list[str]:
    """Every knob a suggestion turns: its own and those of `also` ("run.codec='zlib' and run.out_dtype='float16'")."""
    return [suggestion.knob, *(part.split("=")[0] for part in filter(None, suggestion.also.split(" and ")))]


def time_readout(b) -> str:
    """The run time a panel shows beside the chart, with how it is projected (or why it is not)."""
    if b.time_unknown:
        return f"time {b.time_unknown}"
    return (f"time {b.hours_text()}: {b.config.run.n_samples:,} images at {b.rate_text()} "
            f"({b.speed_method})")


def measure_forward_peaks(config, batch_sizes, on_gpu: bool = False, progress: bool = True,
                          repeats: int = 3) -> ForwardPeaks:
    """Predicted and measured peak bytes of one forward pass per batch size, `repeats` runs each.

    Every run is a fresh subprocess (`measure.encoder_peak`): RSS increase on CPU, CUDA max-allocated
    increase on GPU. The batch sizes run in interleaved rounds (forward, then backward), so a busy
    moment lands on no batch size alone; the spread of each batch size's runs is the RSS noise.
    """
    from nblib.compare import interleaved_order, progress_bar
    from nblib.measure import encoder_peak

    batch_sizes = tuple(batch_sizes)
    predicted = tuple(budget.forward_peak_delta(config.replace(batch_size=b), on_gpu=on_gpu) for b in batch_sizes)
    runs: dict[int, list[float]] = {b: [] for b in batch_sizes}
    order = interleaved_order(batch_sizes, max(1, repeats))
    bar = progress_bar(len(order), "forward passes", "run") if progress else None
    for b in order:
        run = encoder_peak(config.replace(batch_size=b), b, device="cuda" if on_gpu else "cpu")
        runs[b].append(run["cuda_allocated_delta"] if on_gpu else run["rss_delta"])
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return ForwardPeaks(batch_sizes, predicted, tuple(tuple(runs[b]) for b in batch_sizes))
