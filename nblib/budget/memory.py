"""Memory a job holds at its peak: the encoder's weights and live activations, and host RAM lines.

Live-buffer accounting: only the buffers live at the peak count (inference frees activations
between the H_cycles x (L_cycles+1) passes, so recursion costs time, not memory). Each `Line`
is bytes plus a one-line reason. The model arithmetic (parameters, FLOPs, output shapes) lives
here too: every memory and disk line follows from it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from nblib.config import ModelConfig, PipelineConfig
from nblib.units import GB, fmt_bytes

# Host RAM the Python process already holds before the job allocates anything: interpreter,
# numpy, torch (CPU build) ~0.45 GB; with CUDA initialized the host side of the CUDA, cuBLAS and
# cuDNN libraries adds ~1.5 GB (measured on Colab T4 runtimes: ~2 GB RSS after the first kernel).
RUNTIME_RAM_CPU = int(0.45 * GB)
RUNTIME_RAM_CUDA = int(2.0 * GB)
# Each DataLoader worker is a forked Python holding its own copies of touched pages (~150 MB).
LOADER_WORKER_RAM = int(0.15 * GB)
# Share of the activation peak the CUDA caching allocator keeps reserved beyond what is
# allocated (freed temporaries of other sizes it cannot reuse): 10-25% in PyTorch's own
# memory_summary reports for inference; we use 15%.
ALLOCATOR_CACHE_SHARE = 0.15


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


def flops_per_image(model: ModelConfig) -> float:
    """Multiply-adds x 2 of one image's forward pass, the recursion's passes included."""
    d, t, c = model.dim, model.tokens, model.capsules
    per_layer = 2 * t * (3 * d * d + d * d + 2 * model.mlp_ratio * d * d) + 2 * 2 * t * t * d
    stack = model.passes * model.layers * per_layer
    embed = 2 * t * 3 * model.patch ** 2 * d
    pool = 2 * t * d * 2 * d + 2 * 2 * c * t * d + 2 * c * d * d
    heads = 2 * c * d * model.children * d + 2 * c * d * model.checksum_dim
    return float(embed + stack + pool + heads)


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


def model_memory_lines(config: PipelineConfig, *, on_gpu: bool,
                       sdpa_backend: str = "flash") -> tuple[Line, ...]:
    """Weights, input batch and the activations live at the forward pass's peak.

    Live-buffer accounting of nblib.trm, per "stream" of B*T*D elements (checked against a
    tensor-level trace and the measured RSS): the residual stream is fp32 everywhere (the fp16
    patch embedding plus the fp32 position embedding promotes); Linear/GELU/SDPA outputs are
    fp16 under CUDA autocast and fp32 on CPU; LayerNorm outputs are fp32. At the peak, inside a
    block's GELU in the second H cycle, live are x, z_H, z_L and the block's input (4 fp32
    streams) and in the block qkv (3), the attention output (1), the residual (1, fp32), fc1
    and GELU outputs (mlp_ratio each). Earlier passes are freed: recursion adds time, not memory. The
    patchify phase (three fp32 copies of the images) or math attention (scores, softmax and a
    -inf mask) is the peak instead when larger.
    """
    m, r = config.model, config.run
    b, t, d = r.batch_size, m.tokens, m.dim
    act = 2 if on_gpu else 4          # Linear / GELU / SDPA outputs
    res = 4                           # residual stream (fp32 by promotion)
    stream = b * t * d
    pixels = b * m.image_size ** 2 * 3
    n_params = param_count(m)
    buffers = d * m.checksum_dim * 4
    outer = 3 + (m.H_cycles >= 2)                # x, z_L, the block's input, z_H (after cycle 1)
    block_peak = (3 + 1 + 2 * m.mlp_ratio) * act + res   # qkv, attn, fc1, gelu + residual
    blocks = outer * res * stream + block_peak * stream
    patchify = 3 * 4 * pixels                    # float copy, reshaped copy, /255 result
    n_scores = b * m.heads * t * t
    scores = n_scores * (2 * act + 1)            # scores, softmax, _safe_softmax's -inf mask
    attention = (outer * res + 3 * act + 1 * act) * stream + scores
    if sdpa_backend != "math":
        attention = 0
    phases = {"block MLP (GELU)": blocks, "patchify": patchify, "math attention": attention}
    phase = max(phases, key=phases.get)
    scores_live = scores if phase == "math attention" else 0
    lines = [
        Line("weights (fp32)", n_params * 4 + buffers,
             f"{n_params:,} params x 4 B + checksum projection"),
    ]
    if on_gpu:
        lines.append(Line("fp16 weight copies (autocast)", autocast_weight_count(m) * 2,
                          "autocast caches each Linear's fp16 weight for the forward pass"))
    lines += [
        Line("input batch (uint8)", pixels, f"{b} x {m.image_size}^2 x 3 B"),
        Line("activations at peak", phases[phase] - scores_live,
             f"live buffers during the {phase} phase (one pass; earlier passes are freed)"),
        Line("attention scores", scores_live,
             f"math SDPA: B*h*T^2 x ({act} B scores + {act} B softmax + 1 B mask) = "
             f"{fmt_bytes(scores)}"
             + ("" if scores_live else
                (", not live at the peak" if sdpa_backend == "math"
                 else f"; {sdpa_backend} SDPA never materializes them"))),
    ]
    return tuple(lines)


def forward_peak_delta(config: PipelineConfig, *, on_gpu: bool, sdpa_backend: str = "flash") -> int:
    """Bytes one forward pass adds at its peak over the built model and its input batch.

    The measured twin is nblib.measure.encoder_peak (RSS increase on CPU, CUDA max allocated
    increase on GPU): activations and scores live at the peak, plus autocast's fp16 weights.
    """
    lines = {ln.name: ln.bytes for ln in model_memory_lines(config, on_gpu=on_gpu,
                                                              sdpa_backend=sdpa_backend)}
    return (lines["activations at peak"] + lines["attention scores"]
            + lines.get("fp16 weight copies (autocast)", 0))


def activation_bytes(lines: tuple[Line, ...]) -> int:
    """Activations and attention scores among `lines` (what the allocator cache scales with)."""
    return sum(line.bytes for line in lines
               if line.name in ("activations at peak", "attention scores"))


def host_memory_lines(config: PipelineConfig, *, cuda: bool) -> tuple[Line, ...]:
    """Host RAM outside the model: runtime, loader prefetch, outputs held until a part is written."""
    m, r = config.model, config.run
    batch_pixels = r.batch_size * m.image_size ** 2 * 3
    in_flight = max(1, r.workers) * r.prefetch
    held = r.checkpoint_every * output_bytes_per_batch(config)
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
             f"{fmt_bytes(output_bytes_per_batch(config))} ({r.out_dtype})"),
        Line("part assembly copy", r.checkpoint_every * r.batch_size * largest,
             "one output concatenated into its .npy at a time"),
    )
