"""A T4's speed as a sourced range: public PyTorch measurements on a T4, as data, and projections from them.

Each measurement is kept as published (model, batch, shape, latency or rate, with its source and
date); the achieved FLOP/s of each is computed here from FLOPs per sample counted with
`torch.utils.flop_counter.FlopCounterMode` over the same architecture (transformers' BertModel and
ViTModel defaults), never typed in; the suite's TRM's from its config (`flops_per_image`, the count
the budget uses, which FlopCounterMode matches to 0.1%). A projection for any model divides its own
FLOPs per sample (counted the same way on a CPU forward; x3 for a training step) by the achieved
range of its precision, and says so. Nothing here was measured on a GPU by this project: every
figure it gives is a projection.

Trade-off: achieved FLOP/s carries over between models only roughly (kernel mix, batch, memory
bound layers). The range is wide on purpose; the width is the uncertainty, not noise to average.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from nblib.config import ModelConfig, preset
from nblib.errors import ConfigError
from nblib.units import fmt_duration_range

LABEL = "projection"
ACCESSED = "2026-11-25"
SEED_T4_IMAGES = 1_907_747          # nblib.config RunConfig.n_samples, the reference's dataset
GPU_BOUND_MS = 40.0                 # shorter rows measure launch overhead (see _FT_NOTE), not the GPU


@dataclass(frozen=True)
class Source:
    """Where a figure was published: title, address, when (as far as the page shows) and when read."""

    title: str
    url: str
    published: str
    accessed: str = ACCESSED


SOURCES = {
    "fastertransformer": Source(
        "NVIDIA FasterTransformer, docs/bert_guide.md, 'BERT performance on T4 and PyTorch' "
        "(TorchScript column: PyTorch without FasterTransformer)",
        "https://github.com/NVIDIA/FasterTransformer/blob/main/docs/bert_guide.md"
        "#bert-performance-on-t4-and-pytorch",
        "2021-09-30 (commit 952a1f2 added the table; unchanged at the repository's last commit, 2023-10-19)"),
    "hf_torch_compile": Source(
        "Hugging Face Transformers docs, 'Optimize inference using torch.compile()', T4 tables, "
        "'torch 2.0 - no compile' column (google/vit-base-patch16-224, fp32)",
        "https://huggingface.co/docs/transformers/perf_torch_compile",
        "2023 (page copyright; benchmarked on torch 2.0.1)"),
    "nvidia_forum_hgemm": Source(
        "NVIDIA Developer Forums, 'About GPU peak performance' (thread 264462): cuBLAS HGEMM 4096^3 on a "
        "T4 sustains ~24 TFLOP/s; the moderator's answer: power capping at the T4's ~70 W",
        "https://forums.developer.nvidia.com/t/about-gpu-peak-performance/264462",
        "not shown in the stored copy of the thread"),
    "reference": Source(
        "the reference streaming-encode analysis of seed_t4 (nblib.reference.ANALYSIS)",
        "nblib/reference.py", "as quoted by the reference"),
    "t4_datasheet": Source("NVIDIA T4 datasheet: 65 TFLOP/s FP16 tensor, 8.1 TFLOP/s FP32",
                           "https://www.nvidia.com/en-us/data-center/tesla-t4/", "2018"),
}


def flops_per_image(model: ModelConfig) -> float:
    """Multiply-adds x 2 of one image's forward pass of TRMVisionEncoder(model), the recursion's passes included.

    The one FLOP count of the TRM: the budget's time, this module's seed_t4 range and its reference row all use it
    (FlopCounterMode counts the same to 0.1%: tests/test_t4_speed.py).
    """
    d, t, c = model.dim, model.tokens, model.capsules
    per_layer = 2 * t * (3 * d * d + d * d + 2 * model.mlp_ratio * d * d) + 2 * 2 * t * t * d
    stack = model.passes * model.layers * per_layer
    embed = 2 * t * 3 * model.patch ** 2 * d
    pool = 2 * t * d * 2 * d + 2 * 2 * c * t * d + 2 * c * d * d
    heads = 2 * c * d * model.children * d + 2 * c * d * model.checksum_dim
    return float(embed + stack + pool + heads)


# FLOPs per sample, counted by flops_per_sample() with FlopCounterMode (matmuls, convolutions and
# attention; 2 FLOPs per multiply-add) over transformers 5.24.0 BertModel() / ViTModel() defaults;
# tests/test_t4_speed.py recounts each one. The TRM's is counted from its config, typed nowhere.
BERT_BASE_FLOPS = {32: 5_473_566_720, 128: 22_347_251_712, 384: 70_665_633_792}   # per sequence
VIT_B16_FLOPS = 35_127_656_448          # ViTForImageClassification at 224 (BERT-like encoder + 1000-way head)
SEED_T4_FLOPS = flops_per_image(preset("seed_t4").model)       # TRM seed_t4 at 224, per image
TRM_COUNTED_BY = "flops_per_image from the TRM's shapes, FlopCounterMode's count to 0.1%"


@dataclass(frozen=True)
class Measurement:
    """One published T4 measurement of a PyTorch model: its rate and the FLOPs behind it."""

    name: str
    precision: str                 # "fp16" or "fp32"
    batch: int
    seconds_per_batch: float
    flops_per_sample: float
    source: str                    # a key of SOURCES
    note: str = ""

    @property
    def samples_per_s(self) -> float:
        return self.batch / self.seconds_per_batch

    @property
    def achieved_flops(self) -> float:
        """FLOP/s the run reached: batch x FLOPs per sample / seconds per batch."""
        return self.samples_per_s * self.flops_per_sample


_FT_NOTE = ("TorchScript latency on a T4; rows with an fp16 latency under 40 ms are left out: at batch 1 the "
            "table's TorchScript latency is ~10.5 ms whatever the shape, so short rows measure launches")


def _bert(batch: int, seq: int, precision: str, ms: float) -> Measurement:
    return Measurement(f"BERT-base seq {seq}", precision, batch, ms / 1e3, BERT_BASE_FLOPS[seq],
                       "fastertransformer", _FT_NOTE)


def _vit(batch: int, ms: float) -> Measurement:
    return Measurement("ViT-B/16 224", "fp32", batch, ms / 1e3, VIT_B16_FLOPS, "hf_torch_compile",
                       "mean of 300 inferences, eager PyTorch 2.0, fp32")


MEASUREMENTS = (
    _bert(8, 384, "fp32", 180.82), _bert(8, 384, "fp16", 46.82),
    _bert(32, 128, "fp32", 203.04), _bert(32, 128, "fp16", 54.28),
    _bert(32, 384, "fp32", 707.27), _bert(32, 384, "fp16", 192.80),
    _vit(4, 43.653), _vit(16, 163.914),
    Measurement("TRM seed_t4 224", "fp32", 192, 192 / 94, SEED_T4_FLOPS, "reference",
                "the reference's measured 94 samples/s (2.04 s per batch of 192), fp32, the encode loop's rate"),
)

HGEMM_CEILING_FLOPS = 24e12         # nvidia_forum_hgemm: sustained, power-capped; no model beats its GEMMs
T4_FP16_PEAK_FLOPS = 65e12          # t4_datasheet
PRECISIONS = ("fp16", "fp32")


@dataclass(frozen=True)
class Range:
    """low / mid / high of one quantity (mid: the geometric mean of low and high)."""

    low: float
    mid: float
    high: float

    @classmethod
    def of(cls, low: float, high: float) -> Range:
        return cls(low, math.sqrt(low * high), high)


@dataclass(frozen=True)
class Projection:
    """A T4 time for a model, as a range, labelled a projection, with how it was made."""

    samples_per_s: Range
    hours: Range | None            # for n_samples (None when no count was given)
    n_samples: int | None
    flops_per_sample: float
    achieved_flops: Range
    precision: str
    train: bool
    method: str
    label: str = LABEL

    def rate_text(self) -> str:
        """'301 samples/s (249-363)': the mid, then the range; every T4 rate the suite prints reads so."""
        s = self.samples_per_s
        return f"{s.mid:,.0f} samples/s ({s.low:,.0f}-{s.high:,.0f})"

    def hours_text(self) -> str:
        """'1.76 h (1.46-2.13 h)' for n_samples, '7.2 s (6.0-8.7 s)' for a few ('' without a count)."""
        h = self.hours
        return fmt_duration_range(h.low * 3600, h.mid * 3600, h.high * 3600) if h else ""

    def summary(self) -> str:
        text = self.rate_text()
        if self.hours:
            text += f", {self.n_samples:,} samples in {self.hours_text()}"
        return f"{text} on a T4, {self.precision}{' training' if self.train else ''} ({self.label})"


def fp16_fp32_ratios() -> dict[str, float]:
    """fp16 rate / fp32 rate of each model and shape measured in both precisions (the same source)."""
    pairs: dict[tuple, dict[str, Measurement]] = {}
    for m in MEASUREMENTS:
        pairs.setdefault((m.name, m.batch, m.source), {})[m.precision] = m
    return {f"{name} batch {batch}": p["fp16"].samples_per_s / p["fp32"].samples_per_s
            for (name, batch, _), p in pairs.items() if set(p) == {"fp16", "fp32"}}


def achieved_range(precision: str = "fp16") -> tuple[Range, str]:
    """The achieved FLOP/s range of `precision` on a T4 and how it was drawn from MEASUREMENTS.

    fp32: the lowest and highest fp32 rows. fp16: the lowest and highest of the fp16 rows and of each
    fp32 row without an fp16 twin carried over by the lowest and highest fp16/fp32 ratio measured;
    capped at the sustained HGEMM rate.
    """
    _check_precision(precision)
    rows = [m.achieved_flops for m in MEASUREMENTS if m.precision == precision]
    if precision == "fp32":
        return Range.of(min(rows), max(rows)), "lowest and highest achieved FLOP/s of the fp32 T4 measurements"
    ratios = fp16_fp32_ratios().values()
    twins = {(m.name, m.batch) for m in MEASUREMENTS if m.precision == "fp16"}
    carried = [m.achieved_flops * r for m in MEASUREMENTS
               if m.precision == "fp32" and (m.name, m.batch) not in twins for r in (min(ratios), max(ratios))]
    values = rows + carried
    high = min(max(values), HGEMM_CEILING_FLOPS)
    method = (f"lowest and highest achieved FLOP/s of the fp16 T4 measurements and of the fp32 ones carried "
              f"to fp16 by the measured fp16/fp32 ratio ({min(ratios):.2f}-{max(ratios):.2f}), capped at the "
              f"sustained HGEMM rate ({HGEMM_CEILING_FLOPS / 1e12:.0f} TFLOP/s)")
    return Range.of(min(values), high), method


def project(flops_per_sample: float, precision: str = "fp16", train: bool = False,
            n_samples: int | None = None, counted_by: str = "FlopCounterMode on a CPU forward",
            graded_flops_per_sample: float | None = None) -> Projection:
    """A T4 rate and time range for a model of `flops_per_sample` (forward), counted `counted_by`.

    train: a step adds its backward, 2 x the forward FLOPs of what takes gradients: `graded_flops_per_sample`
    (a model that runs part of its forward under no_grad, as the TRM's first H_cycles-1 cycles), else the
    whole forward (x3 in all).
    """
    if flops_per_sample <= 0:
        raise ConfigError(f"flops_per_sample={flops_per_sample} must be > 0; count it with flops_per_sample()")
    achieved, how = achieved_range(precision)
    graded = flops_per_sample if graded_flops_per_sample is None else graded_flops_per_sample
    work = flops_per_sample + (2 * graded if train else 0)
    rate = Range(achieved.low / work, achieved.mid / work, achieved.high / work)
    hours = None if not n_samples else Range(n_samples / rate.high / 3600, n_samples / rate.mid / 3600,
                                             n_samples / rate.low / 3600)
    step = "the forward FLOPs" if not train else "3 x the forward FLOPs (forward + backward)" \
        if graded_flops_per_sample is None else \
        f"the forward FLOPs + 2 x the {graded / 1e9:.2f} GFLOP that take gradients (backward)"
    method = (f"{step} per sample ({work / 1e9:.2f} GFLOP, {counted_by}) divided by the "
              f"{how}; mid = geometric mean")
    return Projection(rate, hours, n_samples, flops_per_sample, achieved, precision, train, method)


def flops_per_sample(model, example) -> float:
    """Forward FLOPs per sample of `model` on a CPU batch `example` (a tensor, or a LoadedModel's uint8 images).

    FlopCounterMode counts matmuls, convolutions and attention; the CPU attention kernel
    (_scaled_dot_product_flash_attention_for_cpu) has no formula in torch, so one is given here.
    """
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    batch = int(example.shape[0])
    with torch.no_grad(), FlopCounterMode(display=False, custom_mapping=_cpu_formulas()) as counter:
        model(example)
    return counter.get_total_flops() / batch


def model_projection(loaded, image_size: int, precision: str = "fp16", train: bool = False,
                     n_samples: int | None = None) -> Projection:
    """`project` for a nblib.models.LoadedModel fed cache images of `image_size` (FLOPs counted here)."""
    import torch

    images = torch.zeros(1, image_size, image_size, 3, dtype=torch.uint8)
    return project(flops_per_sample(loaded, images), precision, train, n_samples)


def seed_t4(precision: str = "fp16", n_samples: int = SEED_T4_IMAGES) -> Projection:
    """The suite's default job (TRM seed_t4, the reference's 1,907,747 images) on a T4, as a projection."""
    return project(SEED_T4_FLOPS, precision, False, n_samples, counted_by=TRM_COUNTED_BY)


def _check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise ConfigError(f"precision={precision!r}: a T4 projection takes fp16 or fp32 (a T4 has no bf16 "
                          f"or TF32 tensor cores)")


def _cpu_formulas() -> dict:
    import torch
    from torch.utils.flop_counter import sdpa_flop_count

    def cpu_sdpa(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
        return sdpa_flop_count(query_shape, key_shape, value_shape)

    return {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: cpu_sdpa}
