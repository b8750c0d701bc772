"""Notebook 01's experiment: the budget's tables, measured peaks against predicted, and the panel's words.

The reference analysis figure by figure against the budget lives in `nblib.budget.reference_check`
(notebook 01 and `python -m nblib budget --reference` print the same table); it is re-exported here.
"""
from __future__ import annotations

from dataclasses import dataclass

from nblib import budget
from nblib.budget.reference_check import (  # noqa: F401  notebook 01 reads these as memory_budgeting.*
    ReferenceCheck,
    activations_at_peak,
    reference_comparison,
    reference_summary,
    reference_table,
)
from nblib.units import GB, MB, fmt_bytes
from nblib.verdict import TOLERANCE


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


def forward_peak(config, device="cpu", sdpa_backend: str | None = None) -> int:
    """Bytes one forward pass adds at its peak over the built model and its input batch, as the budget answers it
    (`activations_at_peak` of `budget.predict_budget`): on a GPU the trace of the encode loop less the input batch,
    on a CPU the RAM lines. The measured twin is `measure.encoder_peak` (CUDA max allocated, or RSS, increase).
    """
    b = budget.predict_budget(config, device, sdpa_backend=sdpa_backend)
    pixels = config.run.batch_size * config.model.image_size ** 2 * 3
    return activations_at_peak(b) - (pixels if b.device.is_gpu else 0)


def this_gpu() -> str:
    """The device preset of this machine's GPU (`budget.preflight.preset_of_this_gpu`: by its name, else a T4)."""
    import torch

    from nblib.budget.preflight import preset_of_this_gpu

    return preset_of_this_gpu(torch.cuda.get_device_name(0))


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
    device = this_gpu() if on_gpu else "cpu"
    predicted = tuple(forward_peak(config.replace(batch_size=b), device) for b in batch_sizes)
    runs: dict[int, list[float]] = {b: [] for b in batch_sizes}
    order = interleaved_order(batch_sizes, max(1, repeats))
    with progress_bar(len(order), "forward passes", "run", disable=not progress) as bar:
        for b in order:
            run = encoder_peak(config.replace(batch_size=b), b, device="cuda" if on_gpu else "cpu")
            runs[b].append(run["cuda_allocated_delta"] if on_gpu else run["rss_delta"])
            bar.update(1)
    return ForwardPeaks(batch_sizes, predicted, tuple(tuple(runs[b]) for b in batch_sizes))
