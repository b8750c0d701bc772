"""The training-memory budget on a CPU: what one optimizer step of the TRM encoder + head holds at its peak.

Beside the encode budget (inference: weights and the live activations of one pass), a training
step also holds gradients (one fp32 per trainable parameter), AdamW's two fp32 moments, under AMP
autocast's fp16 weight copies (the fp32 parameters are the master weights: no second copy), the
GradScaler's scale and growth tracker, and the activations saved for backward. TRM runs its first
H_cycles-1 outer cycles under no_grad, so only the last cycle's L_cycles+1 passes through the block
stack are saved; the earlier cycles cost time, not memory. Counted per block from its operations
(LayerNorm, qkv, SDPA, projection, MLP with GELU): 16 tensors of [B, tokens, dim] in fp32; under
AMP 14 of them are fp16 and the two LayerNorm inputs (the residual stream) stay fp32. Loader
buffers and the checkpoint on disk and on the mirror complete it. Pure Python; `nblib.lab.training`
measures its CPU twins (peak RSS, the largest batch under a memory cap). A GPU's VRAM is not
counted here: it is `nblib.budget.model_vram(..., train=True)`, a trace of the loop's own step.
Trade-off: a count, not a trace: right where activations dominate, an underestimate by the
process's fixed cost elsewhere.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from nblib.budget.memory import LOADER_WORKER_RAM, RUNTIME_RAM_CPU, Line, autocast_weight_count, param_count
from nblib.budget.resources import FIT_MARGIN
from nblib.config import ModelConfig
from nblib.units import fmt_bytes

BLOCK_SAVED_BTD = 16        # [B, T, D] tensors one block saves for backward (see the module docstring)
# ... of which stay fp32 under AMP autocast: the two LayerNorm inputs. They are the residual stream, and
# adding an fp16 branch onto the fp32 stream promotes to fp32 (traced on the simulated T4, nblib.simulate.train)
AMP_FP32_SAVED_BTD = 2
POOL_SAVED_BTD = 5          # final norm in/out, kv input, k and v for the pooling attention
TRANSIENT_BTD = 4           # the widest gradient of a block's backward (the MLP's 4 x BTD), before its input frees
STATE_OVERHEAD = 64 * 1024  # torch.save's zip records, the RNG states, history, data order
BEST_OVERHEAD = 16 * 1024   # the best weights' zip records, config, classes and train settings
SCALER_BYTES = 16           # GradScaler: scale (fp32) + growth tracker (int32) + found_inf per device
RESIDENT = ("python + torch runtime", "parameters (fp32)", "AdamW moments (fp32)")   # held between steps


BEST_KEPT = 1               # best-weights versions kept on each side: a best is written only when the metric
                            # improves, so the newest is the best and older ones are worse copies


def retained_versions(keep_last: int) -> tuple[int, int]:
    """The one retention rule of a training run: (train states, best-weights versions) kept on each side.

    The store prunes by it (`nblib.train.store.TrainStore`), and the budget, the bucket's cost, the
    retention listing and the training panel size the mirror by it (`retained_bytes`).
    """
    return keep_last, BEST_KEPT


def retained_bytes(state_bytes: int, best_bytes: int, keep_last: int, *, saving: bool = False) -> int:
    """Bytes retention keeps on one side: the newest `keep_last` states and the best weights; with `saving`,
    the local peak while a save writes its series one after the other, each pruned before the next is written:
    a series that keeps more than one version loses its oldest first, one that keeps one (the best) keeps it
    until the new one is complete (`nblib.store.retention.local_versions_to_drop`): one version more of that
    series at most.
    """
    states, bests = retained_versions(keep_last)
    extra = max(state_bytes if states < 2 else 0, best_bytes if bests < 2 else 0) if saving else 0
    return states * state_bytes + bests * best_bytes + extra


@dataclass(frozen=True)
class TrainingBudget:
    """Memory lines of one training step, and the checkpoint's bytes on disk and the mirror.

    `mirror` is what retention keeps on a side (`retained_bytes`); `local_disk` is its peak while a save
    writes (`retained_bytes(saving=True)`).
    """

    lines: tuple[Line, ...]
    checkpoint_bytes: int
    local_disk: int
    mirror: int
    batch_size: int
    best_bytes: int = 0
    keep_last: int = 3

    @property
    def total(self) -> int:
        return sum(line.bytes for line in self.lines)

    @property
    def step_bytes(self) -> int:
        """What a step adds to a process that already holds the runtime, the weights and AdamW's state."""
        return self.total - sum(self.line(name) for name in RESIDENT)

    def line(self, name: str) -> int:
        return sum(line.bytes for line in self.lines if line.name == name)

    def table(self) -> str:
        rows = [f"{line.name:<34}{fmt_bytes(line.bytes):>11}  {line.why}" for line in self.lines]
        rows.append(f"{'peak, predicted':<34}{fmt_bytes(self.total):>11}")
        rows.append(f"{'checkpoint (one train state)':<34}{fmt_bytes(self.checkpoint_bytes):>11}")
        rows.append(f"{'best weights (one version)':<34}{fmt_bytes(self.best_bytes):>11}")
        states, bests = retained_versions(self.keep_last)
        rows.append(f"{'mirror (retention)':<34}{fmt_bytes(self.mirror):>11}  last {states} states + {bests} best")
        rows.append(f"{'local disk (retention + a save)':<34}{fmt_bytes(self.local_disk):>11}  "
                    f"the mirror's + the state and best being written")
        return "\n".join(rows)


def trainable_count(model: ModelConfig, n_classes: int) -> int:
    """Parameters the step updates: the encoder without its children head and, with H_cycles > 1,
    without the initial states (no gradient reaches them), plus the head (BatchNorm + Linear).
    """
    frozen = model.dim * model.children * model.dim + model.children * model.dim
    if model.H_cycles > 1:
        frozen += 2 * model.dim
    return param_count(model) - frozen + head_count(model, n_classes)


def head_count(model: ModelConfig, n_classes: int) -> int:
    return 2 * model.dim + model.dim * n_classes + n_classes


def saved_activation_bytes(model: ModelConfig, batch_size: int, precision: str = "fp32") -> int:
    """Bytes autograd keeps for backward: the last outer cycle only (L_cycles + 1 stack passes)."""
    b, t, d = batch_size, model.tokens, model.dim
    item = 4 if precision == "fp32" else 2
    per_block = BLOCK_SAVED_BTD * 4 if precision == "fp32" else \
        AMP_FP32_SAVED_BTD * 4 + (BLOCK_SAVED_BTD - AMP_FP32_SAVED_BTD) * 2     # bytes per [B, T, D] element
    passes = model.L_cycles + 1
    blocks = passes * model.layers * per_block * b * t * d
    patches = b * t * 3 * model.patch ** 2 * 4             # the patchified input, fp32
    pooling = POOL_SAVED_BTD * b * t * d * item
    return blocks + patches + pooling


def predict_training(model: ModelConfig, batch_size: int, *, n_classes: int = 12, precision: str = "fp32",
                     workers: int = 0, prefetch: int = 2, keep_last: int = 3) -> TrainingBudget:
    """The peak RSS of one training step on a CPU at micro-batch `batch_size`, line by line, and the disk lines."""
    total = param_count(model) + head_count(model, n_classes)
    trained = trainable_count(model, n_classes)
    buffers = model.dim * model.checksum_dim * 4 + 2 * model.dim * 4 + 8
    b, t, d = batch_size, model.tokens, model.dim
    image = model.image_size ** 2 * 3
    amp = precision != "fp32"
    lines = [
        Line("python + torch runtime", RUNTIME_RAM_CPU, "measured on Colab and locally"),
        Line("parameters (fp32)", total * 4 + buffers, f"{total:,} params x 4 B + buffers; the AMP master copy"),
        Line("gradients (fp32)", trained * 4, f"{trained:,} trained params x 4 B"),
        Line("AdamW moments (fp32)", trained * 8, "exp_avg + exp_avg_sq: 2 x 4 B per trained param"),
        Line("autocast fp16 weights", autocast_weight_count(model) * 2 if amp else 0,
             "fp16 copies of Linear weights while autocast runs" if amp else "fp32: none"),
        Line("GradScaler", SCALER_BYTES if precision == "fp16" else 0, "scale + growth tracker"),
        Line("activations saved for backward", saved_activation_bytes(model, b, precision),
             f"last of {model.H_cycles} outer cycles: {model.L_cycles + 1} passes x {model.layers} blocks x "
             f"{BLOCK_SAVED_BTD} x B x T x D"),
        Line("backward temporaries", TRANSIENT_BTD * b * t * d * 4, f"{TRANSIENT_BTD} x B x T x D fp32"),
        Line("input batch (uint8)", b * image, "its fp32 patches are among the saved activations"),
    ]
    lines += [
        Line("loader workers", workers * LOADER_WORKER_RAM, f"{workers} x ~150 MB forked Python"),
        Line("prefetched batches", (workers * prefetch if workers else 0) * b * image, "uint8 batches in flight"),
    ]
    checkpoint = (total * 4 + buffers) + trained * 8 + STATE_OVERHEAD
    best = total * 4 + buffers + BEST_OVERHEAD
    return TrainingBudget(tuple(lines), checkpoint, retained_bytes(checkpoint, best, keep_last, saving=True),
                          retained_bytes(checkpoint, best, keep_last), batch_size, best, keep_last)


def largest_batch(model: ModelConfig, cap_bytes: int, *, step_only: bool = False, margin: float = FIT_MARGIN,
                  **kwargs) -> int:
    """The largest micro-batch whose predicted peak fits in `cap_bytes` less `margin` (0 if not even 1 fits):
    the one rule for "fits" (`nblib.budget.resources.fits`).

    step_only: `cap_bytes` is what the step may add (the probe's cap), not the whole process.
    """
    size = (lambda b: predict_training(model, b, **kwargs).step_bytes) if step_only else \
        (lambda b: predict_training(model, b, **kwargs).total)
    fixed = size(0)
    per_sample = size(1) - fixed
    room = cap_bytes * (1 - margin)
    return max(0, int((room - fixed) // per_sample)) if per_sample > 0 else 0


def t4_training_time(model: ModelConfig, n_samples: int, precision: str = "fp16"):
    """The T4 rate and hours of training the TRM `model` over `n_samples`: `nblib.t4_speed.project(..., train=True)`
    on the forward FLOPs the encoding budget counts (`flops_per_image`), whose backward covers only the last outer
    cycle (the first H_cycles-1 run under no_grad): the FLOPs of the same model with one cycle. A projection, a
    range, never a CPU time.
    """
    import dataclasses

    from nblib import t4_speed
    from nblib.budget.memory import flops_per_image

    graded = flops_per_image(dataclasses.replace(model, H_cycles=1))
    return t4_speed.project(flops_per_image(model), precision, train=True, n_samples=n_samples,
                            counted_by="flops_per_image from the TRM's shapes", graded_flops_per_sample=graded)


def accumulation_for(target_batch: int, micro_batch: int) -> tuple[int, int]:
    """(accumulation steps, micro-batch) reaching `target_batch` with micro-batches <= `micro_batch`."""
    if micro_batch < 1:
        raise ValueError("micro_batch must be >= 1: not even one sample fits")
    steps = math.ceil(target_batch / micro_batch)
    while target_batch % steps:
        steps += 1
    return steps, target_batch // steps
