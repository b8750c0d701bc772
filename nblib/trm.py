"""The TRM-style vision encoder: patches -> recursive shared blocks -> capsule pooling.

Tiny Recursive Models reuse one small block stack many times instead of stacking many layers:
for each of H_cycles, L_cycles updates `z_L = f(z_L + z_H + x)`, then `z_H = f(z_H + z_L)`.
Compute grows with H_cycles x (L_cycles + 1), parameters do not. Outputs per image:
sketches [capsules, dim], checksums [capsules, checksum_dim], children [capsules, children, dim].
`InferenceOptions` are opt-in speed knobs for `encode` (precision, SDPA backend, torch.compile, a
channels_last convolution for the patch embedding) that benchmarks/gpu_report.py measures; the
defaults are today's path, byte for byte. Trade-off: a knob that changes the kernels changes the
rounding of the outputs, so none is on until a measurement on a GPU says it pays.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from nblib.atomic import atomic_torch_save
from nblib.config import ModelConfig, PipelineConfig
from nblib.errors import ConfigError, require_choice
from nblib.sdpa import SDPA_BACKENDS, sdpa_context

CHECKSUM_SEED = 0x5EED_C0DE
PRECISIONS = ("auto", "fp32", "fp16", "bf16")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclass(frozen=True)
class InferenceOptions:
    """How `encode` runs; every default is the suite's byte-stable path.

    precision: "auto" (fp16 autocast on CUDA, fp32 on CPU), "fp32", "fp16" or "bf16" (autocast).
    sdpa_backend: None lets PyTorch pick; else one of SDPA_BACKENDS, forced with sdpa_kernel.
    compile_mode: None runs eagerly; else torch.compile(mode=...) with `compile_backend`.
    channels_last_patch_embed: the patch embedding as a strided convolution over the NHWC image
    (no patchify copy); the same weights, a different summation order.
    """

    precision: str = "auto"
    sdpa_backend: str | None = None
    compile_mode: str | None = None
    compile_backend: str = "inductor"
    channels_last_patch_embed: bool = False

    def __post_init__(self):
        require_choice("precision", self.precision, PRECISIONS)
        require_choice("sdpa_backend", self.sdpa_backend, (None, *SDPA_BACKENDS))
        require_choice("compile_mode", self.compile_mode, (None, *COMPILE_MODES))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x)); SDPA attention."""

    def __init__(self, dim: int, heads: int, mlp_ratio: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, mlp_ratio * dim)
        self.fc2 = nn.Linear(mlp_ratio * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        attn = F.scaled_dot_product_attention(q, k, v)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class CapsulePooling(nn.Module):
    """Attention pooling: `capsules` learned queries attend over the tokens."""

    def __init__(self, dim: int, heads: int, capsules: int):
        super().__init__()
        self.heads = heads
        self.queries = nn.Parameter(torch.empty(capsules, dim))
        self.kv = nn.Linear(dim, 2 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        b, t, d = z.shape
        c, h = self.queries.shape[0], self.heads
        q = self.queries.to(z.dtype).view(1, c, h, d // h).transpose(1, 2).expand(b, -1, -1, -1)
        k, v = self.kv(z).view(b, t, 2, h, d // h).permute(2, 0, 3, 1, 4).unbind(0)
        pooled = F.scaled_dot_product_attention(q, k, v)
        return self.out(pooled.transpose(1, 2).reshape(b, c, d))


class TRMVisionEncoder(nn.Module):
    """The recursive vision encoder of the suite; `forward(uint8 [B,H,W,3])` -> dict of outputs."""

    def __init__(self, config: ModelConfig | PipelineConfig, seed: int = 0):
        super().__init__()
        m = config.model if isinstance(config, PipelineConfig) else config
        self.config = m
        self.seed = seed
        d, p = m.dim, m.patch
        self.patch_embed = nn.Linear(3 * p * p, d)
        self.pos_embed = nn.Parameter(torch.empty(m.tokens, d))
        self.z_H_init = nn.Parameter(torch.empty(d))
        self.z_L_init = nn.Parameter(torch.empty(d))
        self.blocks = nn.ModuleList(Block(d, m.heads, m.mlp_ratio) for _ in range(m.layers))
        self.norm = nn.LayerNorm(d)
        self.pool = CapsulePooling(d, m.heads, m.capsules)
        self.children_head = nn.Linear(d, m.children * d)
        # Checksums are a fixed random projection (a Johnson-Lindenstrauss sketch) of each
        # capsule's sketch: not trained, the same for every seed, cheap to compare for
        # near-duplicates. A buffer, so it is saved with the weights but not counted as params.
        gen = torch.Generator().manual_seed(CHECKSUM_SEED)
        proj = torch.randn(d, m.checksum_dim, generator=gen) / math.sqrt(d)
        self.register_buffer("checksum_proj", proj)
        self.reset_parameters(seed)
        self.inference = InferenceOptions()
        self._compiled = None

    def reset_parameters(self, seed: int) -> None:
        """Seeded initialization: the same seed gives the same weights on every machine."""
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in self.named_parameters():
                if name.endswith("bias"):
                    param.zero_()
                elif "norm" in name:
                    param.fill_(1.0)
                else:
                    fan_in = param.shape[-1] if param.dim() > 1 else param.shape[0]
                    param.copy_(torch.randn(param.shape, generator=gen) * (0.5 / math.sqrt(fan_in)))

    def set_inference(self, **changes) -> TRMVisionEncoder:
        """Change how `encode` runs (fields of InferenceOptions); returns self. Weights are untouched."""
        try:
            self.inference = dataclasses.replace(self.inference, **changes)
        except TypeError:
            known = ", ".join(f.name for f in dataclasses.fields(InferenceOptions))
            raise ConfigError(f"unknown inference option in {sorted(changes)}; known: {known}") from None
        object.__setattr__(self, "_compiled", None)
        return self

    def patchify(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 [B,H,W,3] -> float [B, tokens, 3*patch*patch], scaled to [0, 1]."""
        b, hgt, wid, ch = self._check_images(images)
        p = self.config.patch
        x = images.float().view(b, hgt // p, p, wid // p, p, ch).permute(0, 1, 3, 2, 4, 5)
        return x.reshape(b, (hgt // p) * (wid // p), p * p * ch) / 255.0

    def stack(self, z: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            z = block(z)
        return z

    def embed_patches(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 [B,H,W,3] -> patch embeddings [B, tokens, dim] (before the position embedding)."""
        if not self.inference.channels_last_patch_embed:
            return self.patch_embed(self.patchify(images))
        self._check_images(images)
        d, p = self.config.dim, self.config.patch
        # permute(0, 3, 1, 2) of an NHWC tensor is an NCHW view with channels_last strides
        pixels = images.permute(0, 3, 1, 2).float() / 255.0
        weight = self.patch_embed.weight.view(d, p, p, 3).permute(0, 3, 1, 2)
        out = F.conv2d(pixels, weight, self.patch_embed.bias, stride=p)
        return out.flatten(2).transpose(1, 2)

    def sketches(self, images: torch.Tensor, grad_last_cycle_only: bool = False) -> torch.Tensor:
        """uint8 [B,H,W,3] -> sketches [B, capsules, dim] through the recursion; with `grad_last_cycle_only`,
        the first H_cycles-1 outer cycles run under no_grad (TRM training: backward keeps one cycle's activations).
        """
        m = self.config
        x = self.embed_patches(images) + self.pos_embed
        z_h, z_l = self.z_H_init.expand_as(x), self.z_L_init.expand_as(x)
        for cycle in range(m.H_cycles):
            with torch.no_grad() if grad_last_cycle_only and cycle < m.H_cycles - 1 else contextlib.nullcontext():
                for _ in range(m.L_cycles):
                    z_l = self.stack(z_l + z_h + x)
                z_h = self.stack(z_h + z_l)
        return self.pool(self.norm(z_h))

    def forward(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        m = self.config
        sketches = self.sketches(images)
        children = self.children_head(sketches).view(*sketches.shape[:2], m.children, m.dim)
        checksums = sketches @ self.checksum_proj.to(sketches.dtype)
        return {"sketches": sketches, "checksums": checksums, "children": children}

    @torch.inference_mode()
    def encode(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        """Inference: fp16 autocast on CUDA (a T4 has no fast bf16), fp32 on CPU (see set_inference)."""
        with autocast(self.inference.precision, images.device), sdpa_context(self.inference.sdpa_backend):
            return self._runner()(images)

    def save_weights(self, path: str | Path) -> Path:
        """Write the weights and the model config atomically to `path` (a .pt file)."""
        payload = {"config": self.config.__dict__, "state_dict": self.state_dict()}
        return atomic_torch_save(payload, Path(path)).path

    def _check_images(self, images: torch.Tensor) -> tuple[int, int, int, int]:
        b, hgt, wid, ch = images.shape
        if hgt != self.config.image_size or wid != self.config.image_size or ch != 3:
            raise ConfigError(
                f"images are {hgt}x{wid}x{ch}, the encoder expects "
                f"{self.config.image_size}x{self.config.image_size}x3 and does not resize; build a cache at "
                f"that size: python -m nblib cache --images DIR --size {self.config.image_size} --out NEW")
        return b, hgt, wid, ch

    def _runner(self):
        """self, or its torch.compile'd twin (built on first use, rebuilt after set_inference)."""
        if self.inference.compile_mode is None:
            return self
        if self._compiled is None:
            opts = self.inference
            compiled = torch.compile(self, mode=opts.compile_mode, backend=opts.compile_backend)
            # not a submodule: nn.Module.__setattr__ would register the compiled wrapper (which
            # holds self) as a child, and .to(), .eval(), state_dict() would recurse forever
            object.__setattr__(self, "_compiled", compiled)
        return self._compiled


def autocast(precision: str, device):
    """The forward's autocast for a precision on `device` (a torch.device or its name): fp16 or bf16, none for
    fp32; "auto" is fp16 on CUDA and fp32 on the CPU. The one rule of encode (any model) and training.
    """
    device = torch.device(device)
    if precision == "auto":
        precision = "fp16" if device.type == "cuda" else "fp32"
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.float16 if precision == "fp16" else torch.bfloat16)
