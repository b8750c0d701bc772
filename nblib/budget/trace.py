"""A fake CUDA device on a CPU-only torch: real operator semantics, no GPU, every byte accounted.

The tracing machinery the budget (nblib.budget.model_vram) and the simulated T4 (nblib.simulate,
which re-exports it as nblib.simulate.fake_cuda) share; it lives here, in the budget's layer, so
that the budget can trace a model's own code without importing the simulation.

`fake_cuda(gpu)` is FakeTensorMode (tensors carry shape, dtype and device, no data) plus the one
patch that lets CUDA autocast run without a driver: `torch.cuda.amp.common.
amp_definitely_not_available` (the availability guard `torch.autocast("cuda")` checks, which
otherwise disables autocast with a warning). Inside it, `DeviceTrace` (a TorchDispatchMode)
sees every operator as the GPU would run it: composite operators are decomposed to kernels,
attention is routed to the kernel the simulated GPU's architecture has (a T4, sm_75, has the
memory-efficient kernel and math; flash and cuDNN need sm_80), each new device storage is an
allocation replayed through `CachingAllocatorModel`, and each kernel's FLOPs (torch.utils.
flop_counter's formulas) and bytes are kept for the roofline. What it cannot see: the CUDA
context, kernel-internal scratch other than cuBLAS's workspace, and real timing.
"""
from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from nblib.budget.allocator import CachingAllocatorModel, round_size
from nblib.errors import ConfigError

SDPA_KERNELS = {  # backend name (nblib.trm.SDPA_BACKENDS) -> the aten kernel and its min compute capability
    "flash": ("_scaled_dot_product_flash_attention", 80),
    "cudnn": ("_scaled_dot_product_cudnn_attention", 80),
    "efficient": ("_scaled_dot_product_efficient_attention", 50),
    "math": ("_scaled_dot_product_attention_math", 0),
}
# PyTorch's order of preference when several backends are enabled (sdp_utils.cpp, default order)
SDPA_PRIORITY = ("flash", "efficient", "math", "cudnn")
# cuBLAS workspace PyTorch allocates through the caching allocator on a stream's first GEMM
# (aten/src/ATen/cuda/CublasHandlePool.cpp, default CUBLAS_WORKSPACE_CONFIG): 4096 KiB x 2 +
# 16 KiB x 8 before sm_90, 4096 KiB x 8 on sm_90.
# Its place in the allocation order: addmm/mm/bmm are structured kernels (aten/src/ATen/native/
# cuda/Blas.cpp, TORCH_IMPL_FUNC(addmm_out_cuda) and friends), so the generated wrapper allocates
# the output (the meta function's set_output) before the impl runs; the impl calls
# at::cuda::blas::gemm, which takes getCurrentCUDABlasHandle() and there (CublasHandlePool.cpp,
# getCurrentCUDABlasHandle -> cublasSetWorkspace(handle, getCUDABlasWorkspace())) allocates the
# workspace through c10::cuda::CUDACachingAllocator on the (handle, stream)'s first use. So the
# first GEMM's output comes first, its workspace second (WORKSPACE_POSITIONS[0]). (Cited by
# function name from reading the source; line numbers move between releases.)
WORKSPACE_POSITIONS = ("after the first GEMM's output", "before the first GEMM's output",
                       "first on the device")
CUBLAS_WORKSPACE = {False: 4096 * 1024 * 2 + 16 * 1024 * 8, True: 4096 * 1024 * 8}
_GEMMS = {"mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_efficient_attention",
          "_scaled_dot_product_flash_attention", "_scaled_dot_product_cudnn_attention",
          "convolution", "_convolution"}


@dataclass(frozen=True)
class Kernel:
    """One kernel the simulated GPU runs: its operator, FLOPs, bytes moved and precision."""

    op: str
    flops: int
    bytes: int
    dtype: str
    tensor_core: bool     # a GEMM-like kernel (matmul, attention, convolution)


@dataclass(frozen=True)
class PeakOp:
    """The operator that allocated the byte that made the live-bytes peak."""

    op: str
    shape: tuple
    dtype: str
    live_bytes: int


@contextlib.contextmanager
def fake_cuda():
    """FakeTensorMode with CUDA autocast enabled on this CPU-only build; restored on exit."""
    from unittest import mock

    from torch._subclasses.fake_tensor import FakeTensorMode

    with mock.patch("torch.cuda.amp.common.amp_definitely_not_available", return_value=False), \
            FakeTensorMode(allow_non_fake_inputs=True) as mode:
        yield mode


class DeviceTrace(TorchDispatchMode):
    """Allocations, frees, kernels and the live-bytes peak of what runs on `device` inside it."""

    def __init__(self, compute_capability: int = 75, device: str = "cuda"):
        super().__init__()
        self.cc = compute_capability
        self.device_type = device
        self.allocator = CachingAllocatorModel()
        self.kernels: list[Kernel] = []
        self.live = self.max_live = 0          # exact storage bytes
        self.live_rounded = self.max_live_rounded = 0   # in 512 B granules (MemTracker's unit)
        self.tensor_rounded = self.max_tensor_rounded = 0   # the same without the cuBLAS workspace
        self.peak: PeakOp | None = None
        self.sdpa_used: dict[str, int] = {}
        self._seen: weakref.WeakSet = weakref.WeakSet()
        self._workspace = None
        # the allocation stream, for replays with the workspace elsewhere (reserved_by_position):
        # ("m", handle, nbytes), ("f", handle), ("w", handle, nbytes) for the cuBLAS workspace
        self.events: list[tuple] = []

    # -------------------------------------------------------------- public
    def sdpa_backend(self) -> str:
        """The attention kernel this GPU runs under the backends enabled now (sdpa_kernel)."""
        enabled = {"flash": torch.backends.cuda.flash_sdp_enabled(),
                   "efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
                   "math": torch.backends.cuda.math_sdp_enabled(),
                   "cudnn": torch.backends.cuda.cudnn_sdp_enabled()}
        for name in SDPA_PRIORITY:
            if enabled[name] and self.cc >= SDPA_KERNELS[name][1]:
                return name
        forced = [n for n, on in enabled.items() if on]
        raise ConfigError(f"no attention kernel: the enabled SDPA backends {forced} need sm_80 or "
                          f"newer and this simulated GPU is sm_{self.cc}; use 'efficient' or 'math'")

    def track(self, *tensors: torch.Tensor) -> None:
        """Count tensors made outside the trace (already on the device) as allocated now."""
        for t in tensors:
            self._record(t, "external")

    # -------------------------------------------------------------- dispatch
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.scaled_dot_product_attention.default and self.device_type == "cuda":
            with self:
                return self._attention(*args, **kwargs)
        if func.namespace == "aten":
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        out = func(*args, **kwargs)
        self._after(func, args, kwargs, out)           # the output first (structured kernel) ...
        if func.namespace == "aten" and func.__name__.split(".")[0] in _GEMMS:
            self._cublas_workspace(args)                # ... then cuBLAS's workspace (see CUBLAS_WORKSPACE)
        return out

    def mark(self, name: str) -> None:
        """Note a moment in the allocation stream (replay_stats reports the allocated bytes there)."""
        self.events.append(("k", name))

    def reserved_by_position(self) -> dict[str, int]:
        """Max reserved with the cuBLAS workspace at each of WORKSPACE_POSITIONS (the same stream of
        allocations replayed through a fresh allocator model; the first is what the trace ran).
        """
        return {pos: replay_events(self.events, pos) for pos in WORKSPACE_POSITIONS}

    def _attention(self, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                   enable_gqa=False):
        backend = self.sdpa_backend()
        self.sdpa_used[backend] = self.sdpa_used.get(backend, 0) + 1
        aten = torch.ops.aten
        if backend == "math":
            return aten._scaled_dot_product_attention_math(q, k, v, attn_mask, dropout_p, is_causal,
                                                           scale=scale, enable_gqa=enable_gqa)[0]
        if backend == "efficient":
            return aten._scaled_dot_product_efficient_attention(q, k, v, attn_mask, False, dropout_p,
                                                                is_causal, scale=scale)[0]
        if backend == "flash":
            return aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal,
                                                            scale=scale)[0]
        return aten._scaled_dot_product_cudnn_attention(q, k, v, attn_mask, False, dropout_p,
                                                        is_causal, scale=scale)[0]

    def _cublas_workspace(self, args) -> None:
        if self.device_type != "cuda":
            return
        if self._workspace is None and any(isinstance(a, torch.Tensor) and a.device.type == "cuda"
                                           for a in args):
            size = CUBLAS_WORKSPACE[self.cc >= 90]
            self._workspace = self.allocator.malloc(size)   # held for the stream's life
            self.events.append(("w", self._workspace, size))
            self._add_live(size, PeakOp("cuBLAS workspace", (size,), "uint8", 0), tensor=False)

    def _after(self, func, args, kwargs, out) -> None:
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        new = [t for t in outs if self._record(t, str(func))]
        if not new and not func._schema.is_mutable:
            return                                   # a view or metadata: no kernel runs
        ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if not any(t.device.type == self.device_type for t in ins + outs):
            return
        moved = sum(t.numel() * t.element_size() for t in ins + outs)
        dtype = str(outs[0].dtype).replace("torch.", "") if outs else "none"
        self.kernels.append(Kernel(func.__name__, _flops(func, args, kwargs, out), moved, dtype,
                                   func.__name__.split(".")[0] in _GEMMS))

    def _record(self, t: torch.Tensor, op: str) -> bool:
        if t.device.type != self.device_type:
            return False
        st = t.untyped_storage()
        if st in self._seen:
            return False
        self._seen.add(st)
        nbytes = st.nbytes()
        handle = self.allocator.malloc(nbytes)
        self.events.append(("m", handle, nbytes))
        weakref.finalize(st, self._free, handle, nbytes)
        self._add_live(nbytes, PeakOp(op, tuple(t.shape), str(t.dtype).replace("torch.", ""), 0))
        return True

    def _add_live(self, nbytes: int, op: PeakOp, tensor: bool = True) -> None:
        self.live += nbytes
        self.live_rounded += round_size(nbytes)
        if tensor:
            self.tensor_rounded += round_size(nbytes)
            self.max_tensor_rounded = max(self.max_tensor_rounded, self.tensor_rounded)
        if self.live > self.max_live:
            self.max_live = self.live
            self.peak = PeakOp(op.op, op.shape, op.dtype, self.live)
        self.max_live_rounded = max(self.max_live_rounded, self.live_rounded)

    def _free(self, handle: int, nbytes: int) -> None:
        self.allocator.free(handle)
        self.events.append(("f", handle))
        self.live -= nbytes
        self.live_rounded -= round_size(nbytes)
        self.tensor_rounded -= round_size(nbytes)


def attention_as_on_gpu(trace):
    """A TorchFunctionMode that runs F.scaled_dot_product_attention as the simulated GPU would.

    With autograd on, SDPA decomposes before a dispatch mode sees it, and a CPU build's backend
    choice is always math; the GPU picks by architecture (a T4: memory-efficient). This calls that
    kernel's aten op, whose autograd formula saves what the GPU's saves (output and logsumexp).
    """
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode

    aten = torch.ops.aten

    class AttentionAsOnGPU(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is not F.scaled_dot_product_attention:
                return func(*args, **kwargs)
            q, k, v = args[:3]
            if q.device.type != "cuda":
                return func(*args, **kwargs)
            backend = trace.sdpa_backend()
            trace.sdpa_used[backend] = trace.sdpa_used.get(backend, 0) + 1
            if torch.is_autocast_enabled("cuda"):      # SDPA is on autocast's fp16 list
                dtype = torch.get_autocast_dtype("cuda")
                q, k, v = (t.to(dtype) for t in (q, k, v))
            grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
            if backend == "efficient":
                return aten._scaled_dot_product_efficient_attention(q, k, v, None, grad)[0]
            if backend == "flash":
                return aten._scaled_dot_product_flash_attention(q, k, v)[0]
            if backend == "cudnn":
                return aten._scaled_dot_product_cudnn_attention(q, k, v, None, grad)[0]
            return func(q, k, v, *args[3:], **kwargs)

    return AttentionAsOnGPU()


def step_trace_class():
    """DeviceTrace that answers a read of a device value (no data on a fake device) with 0."""

    scalar = torch.ops.aten._local_scalar_dense.default

    class StepTrace(DeviceTrace):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is scalar and getattr(args[0], "constant", None) is None:
                t = args[0]
                return 0.0 if t.dtype.is_floating_point else (False if t.dtype == torch.bool else 0)
            return super().__torch_dispatch__(func, types, args, kwargs)

    return StepTrace


def replay_events(events: list[tuple], position: str = WORKSPACE_POSITIONS[0]) -> int:
    """Max reserved of a trace's allocation stream, with the cuBLAS workspace moved to `position`."""
    return replay_stats(events, position)["max_reserved"]


def replay_stats(events: list[tuple], position: str = WORKSPACE_POSITIONS[0]) -> dict:
    """Max allocated, max reserved and the allocated bytes at each mark, with the workspace at `position`."""
    stream = list(events)
    at = next((i for i, e in enumerate(stream) if e[0] == "w"), None)
    if at is not None and position != WORKSPACE_POSITIONS[0]:
        ws = stream.pop(at)
        if position == WORKSPACE_POSITIONS[1]:
            before = max((i for i in range(at) if stream[i][0] == "m"), default=0)
            stream.insert(before, ws)
        else:
            stream.insert(0, ws)
    allocator, handles, marks = CachingAllocatorModel(), {}, {}
    for event in stream:
        if event[0] == "f":
            allocator.free(handles.pop(event[1]))
        elif event[0] == "k":
            marks[event[1]] = allocator.allocated
        else:
            handles[event[1]] = allocator.malloc(event[2])
    return {"max_allocated": allocator.max_allocated, "max_reserved": allocator.max_reserved, "marks": marks}


def events_at_batch(low: list[tuple], high: list[tuple], b_low: int, b_high: int, b: int) -> list[tuple] | None:
    """The allocation stream at batch `b` from the streams traced at two batches, or None if it is not affine.

    Every storage of a batch-parallel model holds numel x itemsize bytes, affine in the batch (parameters:
    constant), so two traces with the same sequence of events give any batch's stream exactly. A model
    whose operators change with the batch (another event sequence, a size not affine) gets None.
    """
    low, high = _frees_sorted(low), _frees_sorted(high)
    if len(low) != len(high):
        return None
    out = []
    for e0, e1 in zip(low, high):
        if e0[:2] != e1[:2]:
            return None
        if e0[0] in ("m", "w"):
            slope, rest = divmod(e1[2] - e0[2], b_high - b_low)
            size = e0[2] + slope * (b - b_low)
            if rest or size < 0:
                return None
            out.append((e0[0], e0[1], size))
        else:
            out.append(e0)
    return out


def _frees_sorted(events: list[tuple]) -> list[tuple]:
    """Each run of consecutive frees sorted by handle: the order a graph's teardown frees in varies
    between runs (finalizers), and a run's end state does not depend on it (free blocks coalesce).
    """
    out, run = [], []
    for e in events:
        if e[0] == "f":
            run.append(e)
            continue
        out += sorted(run)
        run = []
        out.append(e)
    return out + sorted(run)


def _flops(func, args, kwargs, out) -> int:
    from torch.utils.flop_counter import flop_registry

    formula = flop_registry.get(func.overloadpacket)
    if formula is None:
        return 0
    return int(formula(*args, **kwargs, out_val=out))
