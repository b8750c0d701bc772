"""Memory a job holds at its peak: the encoder's weights and live activations, and host RAM lines.

Live-buffer accounting: only the buffers live at the peak count (inference frees activations
between the H_cycles x (L_cycles+1) passes, so recursion costs time, not memory). Each `Line`
is bytes plus a one-line reason. The model arithmetic (parameters, output shapes) lives here too:
every memory and disk line follows from it; the FLOP count lives below, in nblib.t4_speed, whose
T4 range is drawn from it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from nblib.config import ModelConfig, PipelineConfig
from nblib.t4_speed import flops_per_image  # noqa: F401  the TRM's one FLOP count (nblib.budget.flops_per_image)
from nblib.units import GB, fmt_bytes

# Host RAM the Python process already holds before the job allocates anything: interpreter,
# numpy, torch (CPU build) ~0.45 GB; with CUDA initialized the host side of the CUDA, cuBLAS and
# cuDNN libraries adds ~1.5 GB (measured on Colab T4 runtimes: ~2 GB RSS after the first kernel).
RUNTIME_RAM_CPU = int(0.45 * GB)
RUNTIME_RAM_CUDA = int(2.0 * GB)
# Each DataLoader worker is a forked Python holding its own copies of touched pages (~150 MB).
LOADER_WORKER_RAM = int(0.15 * GB)


@dataclass(frozen=True)
class Line:
    """One item of a budget: bytes and a one-line explanation."""

    name: str
    bytes: int
    why: str


def param_count(model: ModelConfig) -> int:
    """Trainable parameters of TRMVisionEncoder(model), counted from the layer shapes."""
    d, p, r = model.dim, model.patch, model.mlp_ratio
    linear = lambda n_in, n_out: n_in * n_out + n_out  # noqa: E731  weight + bias
    norm = 2 * d
    block = norm + linear(d, 3 * d) + linear(d, d) + norm + linear(d, r * d) + linear(r * d, d)
    return (linear(3 * p * p, d)              # patch embedding
            + model.tokens * d                # position embedding
            + 2 * d                           # z_H and z_L initial states
            + model.layers * block            # the shared block stack
            + norm                            # final norm
            + model.capsules * d + linear(d, 2 * d) + linear(d, d)   # capsule pooling
            + linear(d, model.children * d))  # children head


def autocast_weight_count(model: ModelConfig) -> int:
    """Parameters autocast casts to fp16 and caches: every Linear's weight and bias."""
    d, p, r = model.dim, model.patch, model.mlp_ratio
    linear = lambda n_in, n_out: n_in * n_out + n_out  # noqa: E731
    block = linear(d, 3 * d) + linear(d, d) + linear(d, r * d) + linear(r * d, d)
    return (linear(3 * p * p, d) + model.layers * block + linear(d, 2 * d) + linear(d, d)
            + linear(d, model.children * d))


def output_shapes(model: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Per-image output shapes: sketches [C,D], checksums [C,K], children [C,N,D]."""
    return {"sketches": (model.capsules, model.dim),
            "checksums": (model.capsules, model.checksum_dim),
            "children": (model.capsules, model.children, model.dim)}


def output_bytes_per_image(config: PipelineConfig, outputs=None, out_dtype=None) -> int:
    """Bytes one image's kept outputs take at the run's output dtype."""
    r = config.run
    itemsize = {"float16": 2, "float32": 4}[out_dtype or r.out_dtype]
    shapes = output_shapes(config.model)
    return sum(math.prod(shapes[name]) * itemsize for name in (outputs or r.outputs))


def output_bytes_per_batch(config: PipelineConfig) -> int:
    """Bytes one batch's kept outputs take at the run's output dtype."""
    return config.run.batch_size * output_bytes_per_image(config)


def model_memory_lines(config: PipelineConfig, *, sdpa_backend: str = "flash") -> tuple[Line, ...]:
    """Host RAM of the model on a CPU: weights, input batch and the activations live at the forward pass's peak.

    Live-buffer accounting of nblib.trm in fp32, per "stream" of B*T*D elements (checked against the
    measured RSS by benchmarks/budget_accuracy.py and nblib.measure.encoder_peak): at the peak, inside
    a block's GELU in the second H cycle, live are x, z_H, z_L and the block's input (4 streams) and in
    the block qkv (3), the attention output (1), the residual (1), fc1 and GELU outputs (mlp_ratio each).
    Earlier passes are freed: recursion adds time, not memory. The patchify phase (three fp32 copies of
    the images) or math attention is the peak instead when larger. A GPU's VRAM is not counted here:
    it is the trace of the encode loop (nblib.budget.encode_trace, through predict_budget), the one answer.
    """
    m, r = config.model, config.run
    b, t, d = r.batch_size, m.tokens, m.dim
    stream = b * t * d * 4
    pixels = b * m.image_size ** 2 * 3
    n_params = param_count(m)
    outer = 3 + (m.H_cycles >= 2)                # x, z_L, the block's input, z_H (after cycle 1)
    blocks = (outer + 3 + 1 + 1 + 2 * m.mlp_ratio) * stream    # + qkv, attn, residual, fc1, gelu
    scores = b * m.heads * t * t * (2 * 4 + 1)   # scores, softmax, _safe_softmax's -inf mask
    phases = {"block MLP (GELU)": blocks, "patchify": 3 * 4 * pixels,   # float copy, reshaped copy, /255
              "math attention": (outer + 3 + 1) * stream + scores if sdpa_backend == "math" else 0}
    phase = max(phases, key=phases.get)
    scores_live = scores if phase == "math attention" else 0
    why = f"math SDPA: B*h*T^2 x (4 B scores + 4 B softmax + 1 B mask) = {fmt_bytes(scores)}"
    return (
        Line("weights (fp32)", n_params * 4 + d * m.checksum_dim * 4,
             f"{n_params:,} params x 4 B + checksum projection"),
        Line("input batch (uint8)", pixels, f"{b} x {m.image_size}^2 x 3 B"),
        Line("activations at peak", phases[phase] - scores_live,
             f"live buffers during the {phase} phase (one pass; earlier passes are freed)"),
        Line("attention scores", scores_live,
             why + ("" if scores_live else ", not live at the peak" if sdpa_backend == "math"
                    else f"; {sdpa_backend} SDPA never materializes them")),
    )


def forward_peak_delta(config: PipelineConfig, *, sdpa_backend: str = "flash") -> int:
    """Bytes one forward pass on a CPU adds at its peak over the built model and its input batch.

    The measured twin is nblib.measure.encoder_peak's RSS increase: activations and scores live at the peak.
    """
    lines = {ln.name: ln.bytes for ln in model_memory_lines(config, sdpa_backend=sdpa_backend)}
    return lines["activations at peak"] + lines["attention scores"]


def pinned_bytes(nbytes: int) -> int:
    """Page-locked RAM PyTorch's caching host allocator takes for a pinned buffer of `nbytes`.

    It rounds every pinned allocation up to the next power of two (CachingHostAllocator), so a
    buffer of 3.57 GB takes 4.29 GB of page-locked RAM.
    """
    return 1 << max(0, int(nbytes) - 1).bit_length() if nbytes > 0 else 0


def host_memory_lines(config: PipelineConfig, *, cuda: bool) -> tuple[Line, ...]:
    """Host RAM outside the model: runtime, loader prefetch, outputs held until a part is written.

    On CUDA the part's host buffers are one pinned block (nblib.encode.offload.HostPart), which
    PyTorch's caching host allocator rounds up to a power of two (`pinned_bytes`).
    """
    m, r = config.model, config.run
    batch_pixels = r.batch_size * m.image_size ** 2 * 3
    in_flight = max(1, r.workers) * r.prefetch
    part_samples = r.checkpoint_every * r.batch_size
    held = r.checkpoint_every * output_bytes_per_batch(config)
    if cuda:
        held = pinned_bytes(part_samples * output_bytes_per_image(config))
    largest = max(output_bytes_per_image(config, outputs=(name,)) for name in r.outputs)
    return (
        Line("python + torch runtime", RUNTIME_RAM_CUDA if cuda else RUNTIME_RAM_CPU,
             "interpreter, numpy, torch" + (" and the host side of CUDA" if cuda else "")),
        Line("loader workers", r.workers * LOADER_WORKER_RAM,
             f"{r.workers} forked worker processes x ~{LOADER_WORKER_RAM / GB:.2f} GB"),
        Line("prefetched batches", in_flight * batch_pixels,
             f"{in_flight} uint8 batches in flight (max(1, workers) x prefetch)"),
        Line("outputs held until the part", held,
             f"checkpoint_every={r.checkpoint_every} batches x "
             f"{fmt_bytes(output_bytes_per_batch(config))} ({r.out_dtype})"
             + (", one pinned block rounded up to a power of two" if cuda else "")),
        Line("part assembly copy", r.checkpoint_every * r.batch_size * largest,
             "one output concatenated into its .npy at a time"),
    )
