"""The reference analysis of seed_t4 figure by figure against the budget (notebook 01, `budget --reference`).

Each reference figure (nblib.reference.ANALYSIS) is set beside the budget's own figure for the
same quantity; the verdict is computed: "right" when the two agree within `tolerance`
(default 10%), "wrong" otherwise. The reasons say where a gap comes from, with the numbers.
Memory figures are the budget's own lines (`predict_budget`): on a GPU the activations are the trace of
the encode loop (nblib.budget.encode_trace), on a CPU the RAM lines; nothing here computes them again.
"""
from __future__ import annotations

from dataclasses import dataclass

from nblib.budget.devices import Device
from nblib.budget.disk import cache_bytes
from nblib.budget.memory import output_bytes_per_batch, output_bytes_per_image, param_count
from nblib.budget.predict import Budget, predict_budget
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


def reference_comparison(device: str | Device = "t4",
                         tolerance: float = TOLERANCE) -> list[ReferenceCheck]:
    """The reference analysis of seed_t4, figure by figure, against the budget for `device`."""
    from nblib.config import preset

    cfg = preset("seed_t4")
    m, r = cfg.model, cfg.run
    b = predict_budget(cfg, device)
    math = predict_budget(cfg, device, sdpa_backend="math")
    lines = {line.name: line.bytes for line in b.lines["ram"]}
    n_params = param_count(m)
    heads = m.capsules * m.dim + 3 * m.dim * m.dim + 3 * m.dim + m.children * m.dim * m.dim + m.children * m.dim
    encoder = n_params - heads
    pixels = r.batch_size * m.image_size ** 2 * 3
    per_batch16 = output_bytes_per_batch(cfg.replace(out_dtype="float16"))
    per_batch32 = output_bytes_per_batch(cfg.replace(out_dtype="float32"))
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
              activations_at_peak(math) - activations_at_peak(b), "B",
              f"what math SDPA adds to the peak: {f(activations_at_peak(math))} with sdpa_backend='math' "
              f"less {f(activations_at_peak(b))} with {b.sdpa_backend} ({_source(b)})"),
        check("activation peak", ["activation peak"], activations_at_peak(b), "B",
              f"live at the forward pass's peak, {b.sdpa_backend} SDPA ({_source(b)})"),
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
        check("image cache", ["image cache"], cache_bytes(r.n_samples, m.image_size, "raw"), "B",
              f"raw uint8, {m.image_size}^2 x 3 B per image; the reference's size is "
              f"{ANALYSIS['image cache'].value / r.n_samples / 1e3:.0f} KB per image"),
        check("checkpoints", ["checkpoints total"], r.n_samples * output_bytes_per_image(cfg), "B",
              f"{n_parts} parts x {f(r.checkpoint_every * per_batch16)}: each part holds its own batches"),
        check("run time", ["run time"], r.n_batches * s_per_batch / 3600, "h",
              f"{r.n_batches:,} batches x the measured {s_per_batch} s (fp32); in fp16 the budget projects "
              f"{b.rate_text()} ({b.speed.label + ', nblib.t4_speed' if b.speed else b.speed_method}) against the "
              f"measured fp32 {ANALYSIS['samples per second'].value}"),
    ]


def activations_at_peak(b: Budget) -> int:
    """The bytes a budget's forward pass holds live at its peak beyond what stays between batches: on a GPU the
    trace's line (input batch included), on a CPU the RAM lines (activations and attention scores).
    """
    names = ("input batch and activations at the peak", "activations at peak", "attention scores")
    return sum(line.bytes for group in b.lines.values() for line in group if line.name in names)


def _source(b: Budget) -> str:
    """Where `activations_at_peak(b)` comes from, in words."""
    if b.device.is_gpu:
        why = next(line.why for line in b.lines["vram"] if line.name == "input batch and activations at the peak")
        op = why.partition("peak (")[2].partition(")")[0]
        return f"the encode loop traced on the simulated {b.device.name}, peak at {op}"
    return "the budget's RAM lines on a CPU"


def reference_table(device: str | Device = "t4", tolerance: float = TOLERANCE) -> str:
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
