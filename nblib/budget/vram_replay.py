"""The encode loop's device allocations, op by op, replayed through the caching-allocator model.

The allocator cache is set by *where* blocks land, not only by how many bytes are live: a
cuBLAS workspace allocated at the first GEMM (after its output, PyTorch's order) inside a freed
patchify block, or a small output
that splits a stream-sized block, decides whether the next 4-stream MLP buffer finds a hole or
needs a new segment. So this replay follows nblib.trm's forward pass and nblib.encode's
per-batch steps in their order, with the sizes the model arithmetic gives (every block of at
least 512 B that the simulated T4 of nblib.simulate sees on the device, in the order it sees
them): the input copy, the patchify copies, each Linear (under fp16 autocast: the per-call fp16
weight copy and input cast), LayerNorm, attention (efficient, or math with its fp32 scores),
GELU, the residual adds, the heads, and the offload's casts and `torch.cat`. Pure Python, no
torch: the budget stays importable without it.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from nblib.budget.allocator import CachingAllocatorModel
from nblib.config import PipelineConfig


@dataclass(frozen=True)
class _Shape:
    """Element counts and item sizes of one batch, from the config."""

    rows: int            # B * tokens
    dim: int
    mlp: int             # mlp_ratio * dim
    pixels: int          # B * H * W * 3
    scores: int          # B * heads * tokens^2
    pooled_rows: int     # B * capsules
    children: int
    checksum: int
    act: int             # item size of Linear / GELU / attention outputs (2 under fp16 autocast)


class _Replay:
    """One device's allocations: the allocator model, the lazy cuBLAS workspace, autocast copies."""

    def __init__(self, shape: _Shape, workspace: int, cache_weight_copies: bool, math: bool,
                 position: str = "after"):
        self.alloc = CachingAllocatorModel()
        self.position = position                     # the workspace: "after" the first GEMM's output
        if position == "first":                      # (PyTorch's order), "before" it, or "first" on the device
            self.alloc.malloc(workspace)
        self.s, self.workspace, self.cached, self.math = shape, workspace, cache_weight_copies, math
        self.half = shape.act == 2
        self._weight_copies: dict[str, int] = {}
        self._gemm_seen = False

    def m(self, nbytes: int) -> int:
        return self.alloc.malloc(nbytes)

    def f(self, *handles: int | None) -> None:
        for h in handles:
            if h is not None:
                self.alloc.free(h)

    def linear(self, name: str, rows: int, n_in: int, n_out: int, *, input_half: bool) -> int:
        """Linear `name` over `rows` rows: autocast's weight copy and input cast, workspace, output."""
        weight = cast = None
        if self.half:
            if name not in self._weight_copies:
                weight = self.m(n_in * n_out * 2)
                if self.cached:
                    self._weight_copies[name], weight = weight, None
            if not input_half:
                cast = self.m(rows * n_in * 2)
        out = self.m(rows * n_out * self.s.act) if self.position != "before" or self._gemm_seen else None
        if not self._gemm_seen:
            self._gemm_seen = True
            if self.position != "first":
                self.m(self.workspace)               # held for the stream's life
            if out is None:
                out = self.m(rows * n_out * self.s.act)
        self.f(cast, weight)
        return out

    def leave_autocast(self) -> None:
        """Leaving autocast clears its weight-copy cache (torch <= 2.9 keeps copies until then)."""
        self.f(*self._weight_copies.values())
        self._weight_copies.clear()

    def attention(self) -> tuple[int, int | None]:
        """The block's attention output, and a copy its transpose-reshape needs (math only)."""
        s, stream = self.s, self.s.rows * self.s.dim
        if not self.math:
            return self.m(stream * s.act), None
        upcast = [self.m(stream * 4) for _ in range(3)] if self.half else []
        scaled_q, k_t, q, k_t2 = (self.m(stream * 4) for _ in range(4))
        scores = self.m(s.scores * 4)
        self.f(q, k_t2, k_t)
        probs = self.m(s.scores * 4)
        self.f(scores)
        probs_half = self.m(s.scores * 2) if self.half else None
        v = self.m(stream * 4)
        out = self.m(stream * 4)
        self.f(v)
        if self.half:
            out_half = self.m(stream * 2)
            self.f(out, probs, scaled_q, *upcast, probs_half)
            out = out_half
        else:
            self.f(scaled_q, probs)
        return out, self.m(stream * s.act)

    def block(self, layer: int) -> int:
        """One TRM block over a held input: returns its output; frees everything else it made."""
        s = self.s
        res = s.rows * s.dim * 4
        norm1 = self.m(res)
        qkv = self.linear(f"{layer}.qkv", s.rows, s.dim, 3 * s.dim, input_half=False)
        self.f(norm1)
        attn, reshaped = self.attention()
        proj = self.linear(f"{layer}.proj", s.rows, s.dim, s.dim, input_half=self.half)
        self.f(reshaped)
        after_attn = self.m(res)
        self.f(proj)
        norm2 = self.m(res)
        fc1 = self.linear(f"{layer}.fc1", s.rows, s.dim, s.mlp, input_half=False)
        self.f(norm2)
        gelu = self.m(s.rows * s.mlp * s.act)
        self.f(fc1)
        fc2 = self.linear(f"{layer}.fc2", s.rows, s.mlp, s.dim, input_half=self.half)
        self.f(gelu)
        out = self.m(res)
        self.f(fc2, after_attn, qkv, attn)
        return out

    def stack(self, z: int, layers: int) -> int:
        """`for block in blocks: z = block(z)`: each block's input is freed once it returns."""
        for layer in range(layers):
            out = self.block(layer)
            self.f(z)
            z = out
        return z

    def heads(self) -> list[int]:
        """Final norm, capsule pooling, children head and checksums: the model-dtype outputs."""
        s = self.s
        norm = self.m(s.rows * s.dim * 4)
        kv = self.linear("pool.kv", s.rows, s.dim, 2 * s.dim, input_half=False)
        pooled = self.m(s.pooled_rows * s.dim * s.act)
        if self.half:                              # the fp16 output's transpose-reshape copies
            reshaped = self.m(s.pooled_rows * s.dim * s.act)
            self.f(pooled)
            pooled = reshaped
        sketches = self.linear("pool.out", s.pooled_rows, s.dim, s.dim, input_half=self.half)
        self.f(kv, pooled, norm)
        children = self.linear("children", s.pooled_rows, s.dim, s.children * s.dim, input_half=self.half)
        checksums = self.m(s.pooled_rows * s.checksum * s.act)
        return [sketches, checksums, children]


def replay_reserved(config: PipelineConfig, *, weights: list[int], precision: str, sdpa_backend: str,
                    offload: str, workspace: int, cache_weight_copies: bool, position: str = "after") -> int:
    """Peak reserved bytes of the caching-allocator model over the encode loop's batches.

    As many batches as nblib.simulate runs to reach the steady state: three with
    offload="async"; with "consolidate", one full group of `consolidate_every` batches, its
    concatenation and copy, and two more. `position` places the cuBLAS workspace: "after" the first
    GEMM's output, PyTorch's order (a structured addmm allocates its output, then at::cuda::blas::gemm
    takes the handle's workspace: nblib.budget.trace), "before" it, or "first" on the device.
    """
    r = config.run
    every = r.consolidate_every if offload == "consolidate" else 1
    return _replay_reserved(config.model, r.batch_size, r.out_dtype, tuple(r.outputs), every, tuple(weights),
                            precision, sdpa_backend, offload, workspace, cache_weight_copies, position)


@lru_cache(maxsize=4096)
def _replay_reserved(m, batch_size: int, out_dtype: str, outputs: tuple, every: int, weights: tuple,
                     precision: str, sdpa_backend: str, offload: str, workspace: int, cache_weight_copies: bool,
                     position: str) -> int:
    """replay_reserved on the inputs that move it, cached: the advice's searches and the widgets ask
    the same VRAM question again for every knob that leaves VRAM alone (Drive cadence, quota, disk).
    """
    half = precision in ("fp16", "bf16", "auto")
    shape = _Shape(rows=batch_size * m.tokens, dim=m.dim, mlp=m.mlp_ratio * m.dim,
                   pixels=batch_size * m.image_size ** 2 * 3, scores=batch_size * m.heads * m.tokens ** 2,
                   pooled_rows=batch_size * m.capsules, children=m.children, checksum=m.checksum_dim,
                   act=2 if half else 4)
    out_itemsize = {"float16": 2, "float32": 4}[out_dtype]
    order = ("sketches", "checksums", "children")
    kept = [order.index(name) for name in outputs]
    batches = every + 2 if offload == "consolidate" else 3
    run = _Replay(shape, workspace, cache_weight_copies and half, sdpa_backend == "math", position)
    for size in weights:
        run.m(size)
    images, pending = None, []
    for _ in range(batches):
        new = run.m(shape.pixels)                      # images = next(loader).to(device)
        run.f(images)
        images = new
        outputs = _forward(run, m)
        copy = offload != "async" or out_itemsize != shape.act
        cast = [run.m(_out_size(shape, i, out_itemsize)) if copy else None for i in kept]
        run.f(*outputs)
        if offload == "async":
            run.f(*cast)
            continue
        pending.append(cast)
        if len(pending) == every:
            joined = [run.m(sum(_out_size(shape, i, out_itemsize) for _ in pending)) for i in kept]
            for cast_batch in pending:
                run.f(*cast_batch)
            pending.clear()
            run.f(*joined)
    return run.alloc.max_reserved


def _forward(run: _Replay, m) -> list[int]:
    """TRMVisionEncoder.forward: patchify, embed, H x (L + 1) stacks, heads; returns the outputs."""
    s = run.s
    floats = run.m(s.pixels * 4)                   # images.float()
    patches = run.m(s.pixels * 4)                  # the permuted reshape's copy
    scaled = run.m(s.pixels * 4)                   # / 255
    run.f(patches, floats)
    embedded = run.linear("patch_embed", s.rows, 3 * m.patch ** 2, s.dim, input_half=False)
    run.f(scaled)
    x = run.m(s.rows * s.dim * 4)                  # + pos_embed (fp32)
    run.f(embedded)
    res = s.rows * s.dim * 4
    z_h = z_l = None                               # expanded initial states: views, no storage
    for _ in range(m.H_cycles):
        for _ in range(m.L_cycles):
            partial = run.m(res)
            summed = run.m(res)
            run.f(partial)
            new = run.stack(summed, m.layers)
            run.f(z_l)
            z_l = new
        summed = run.m(res)
        new = run.stack(summed, m.layers)
        run.f(z_h)
        z_h = new
    outputs = run.heads()
    run.f(x, z_h, z_l)
    run.leave_autocast()
    return outputs


def _out_size(shape: _Shape, index: int, itemsize: int) -> int:
    per_row = (shape.dim, shape.checksum, shape.children * shape.dim)[index]
    return shape.pooled_rows * per_row * itemsize

