"""A fake CUDA device on a CPU-only torch: real operator semantics, no GPU, every byte accounted.

The tracing machinery of the trace layer, which the budget (nblib.budget.model_vram, through
traced_jobs) and the simulated T4 (nblib.simulate) share; it lives in the budget's layer, below
the jobs whose code it traces.

`fake_cuda(gpu)` is FakeTensorMode (tensors carry shape, dtype and device, no data) plus the one
patch that lets CUDA autocast run without a driver: `torch.cuda.amp.common.
amp_definitely_not_available` (the availability guard `torch.autocast("cuda")` checks, which
otherwise disables autocast with a warning). Inside it, `DeviceTrace` (a TorchDispatchMode)
sees every operator as the GPU would run it: composite operators are decomposed to kernels,
attention is routed to the kernel the simulated GPU's architecture has (a T4, sm_75, has the
memory-efficient kernel and math; flash and cuDNN need sm_80), each new device storage is an
allocation replayed through `CachingAllocatorModel`, and each kernel's FLOPs (torch.utils.
flop_counter's formulas) and bytes are kept for the roofline. What it cannot see: the CUDA
context, kernel-internal scratch other than cuBLAS's workspaces (cuDNN's convolution workspaces,
cuBLASLt's 1 MiB, the attention backward's accumulators), and real timing. Checked on an H100
(torch 2.11, tiny HF ViT / Swin / ResNet, fp16), traced over measured max allocated: ViT encode 0.98,
training 0.99 (0.97 checkpointed), Swin encode 1.07, training 1.00, ResNet encode 0.91 (cuDNN's
workspaces), training 1.00; max reserved differs more where transient scratch splits segments.
"""
from __future__ import annotations

import contextlib
import math
import weakref
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from nblib.budget.allocator import (
    WORKSPACE_POSITIONS,
    CachingAllocatorModel,
    cublas_workspace_bytes,
    replay_stats,
    round_size,
)
from nblib.errors import ConfigError

SDPA_KERNELS = {  # backend name (nblib.trm.SDPA_BACKENDS) -> the aten kernel and its min compute capability
    "flash": ("_scaled_dot_product_flash_attention", 80),
    "cudnn": ("_scaled_dot_product_cudnn_attention", 80),
    "efficient": ("_scaled_dot_product_efficient_attention", 50),
    "math": ("_scaled_dot_product_attention_math", 0),
}
# PyTorch's order of preference when several backends are enabled (sdp_utils.cpp, default order)
SDPA_PRIORITY = ("flash", "efficient", "math", "cudnn")
# cuBLAS workspace PyTorch allocates through the caching allocator, once per (cuBLAS handle, stream)
# (aten/src/ATen/cuda/CublasHandlePool.cpp): getCurrentCUDABlasHandle() reserves the calling thread's
# handle (a thread_local PoolWindow of DeviceThreadHandlePool: one handle per thread and device) and calls
# setWorkspaceForHandle(handle, stream), which allocates getChosenWorkspaceSize() bytes through
# c10::cuda::CUDACachingAllocator the first time its key (handle, stream) is seen in
# cublas_handle_stream_to_workspace(). parseChosenWorkspaceSize() reads CUBLAS_WORKSPACE_CONFIG as
# ":SIZE_KiB:COUNT" pairs (regex ":([0-9]+):([0-9]+)", summed); unset or unparsable: 4096 KiB x 2 + 16 KiB x 8,
# or 4096 KiB x 8 on sm_90 exactly. Training's backward runs on the autograd engine's device thread
# (Engine::thread_init, one per device), so its GEMMs take a second handle and a second workspace: two on
# a GPU (measured on an H100, torch 2.11: two blocks of the configured size after a Linear's backward, one
# after its forward). Only cuBLAS GEMMs take it: cuDNN's convolutions and the cutlass attention kernels
# (memory-efficient, flash) do not (measured: a conv net's training step holds none).
# Its place in the allocation order: addmm/mm/bmm are structured kernels (aten/src/ATen/native/
# cuda/Blas.cpp, TORCH_IMPL_FUNC(addmm_out_cuda) and friends), so the generated wrapper allocates
# the output (the meta function's set_output) before the impl runs; the impl calls
# at::cuda::blas::gemm, which takes getCurrentCUDABlasHandle() and there the workspace. So the
# first GEMM's output comes first, its workspace second (WORKSPACE_POSITIONS[0]). (Cited by
# function name from reading the source; line numbers move between releases.)
# Not modelled: cuBLASLt's own workspace (getCUDABlasLtWorkspace, CUBLASLT_WORKSPACE_SIZE, default
# 1 MiB per handle and stream) that addmm with a bias vector takes on the Lt path (measured on the H100).
_CUBLAS_GEMMS = {"mm", "addmm", "bmm", "baddbmm", "addbmm", "addmv", "mv", "dot", "vdot", "_addmm_activation",
                 "addr", "_int_mm"}
_GEMMS = _CUBLAS_GEMMS | {"_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
                          "_scaled_dot_product_cudnn_attention", "convolution", "_convolution"}   # tensor-core kernels

_run = {"cublas_config": None}     # the traced run's CUBLAS_WORKSPACE_CONFIG (set_run_cublas_config)


def set_run_cublas_config(config: str | None) -> None:
    """The CUBLAS_WORKSPACE_CONFIG of the run a child process traces (nblib.budget.shim.load_shim sets it)."""
    _run["cublas_config"] = config


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


# CUDA autocast where each torch function is called (`_autocast_at_call`): a dispatch mode's handler runs below
# autocast, with its key excluded, so torch.is_autocast_enabled() reads False there whatever the caller had
_call_site = {"autocast": False}


@contextlib.contextmanager
def fake_cuda():
    """FakeTensorMode with CUDA autocast enabled on this CPU-only build; restored on exit."""
    from unittest import mock

    from torch._subclasses.fake_tensor import FakeTensorMode

    with mock.patch("torch.cuda.amp.common.amp_definitely_not_available", return_value=False), \
            FakeTensorMode(allow_non_fake_inputs=True) as mode, _autocast_at_call():
        yield mode


def _autocast_at_call():
    """A TorchFunctionMode that notes, at each torch function called, whether CUDA autocast is on there."""
    from torch.overrides import TorchFunctionMode

    class AutocastAtCall(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            _call_site["autocast"] = torch.is_autocast_enabled("cuda")
            return func(*args, **(kwargs or {}))

    return AutocastAtCall()


_has_kernel: dict = {}    # (operator, dispatch key) -> whether torch registers a kernel of its own there


def _has(func, key) -> bool:
    if (func, key) not in _has_kernel:
        _has_kernel[func, key] = torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), key)
    return _has_kernel[func, key]


def decompose_as_on_gpu(site: list, func, args, kwargs):
    """A composite operator's decomposition as the GPU's dispatcher runs it; NotImplemented for a kernel.

    The C++ CompositeImplicitAutograd kernel where torch has one (F.interpolate's upsample_*.vec calls upsample_*,
    on autocast's fp32 list, where the Python decomposition `func.decompose` prefers computes inline in the
    input's dtype), else the Python decomposition, which stands for one GPU kernel: below autocast, as that is.
    Autocast: under inference_mode no autograd key decomposes a composite above the Python key, so it reaches the
    trace whole (conv2d.padding: a `padding="same"` convolution) and is decomposed in this handler, where
    autocast's key is excluded. On the GPU it runs at the CUDA key: where autocast has no kernel for it (a
    fallthrough), its inner calls (convolution) pass through autocast as its caller had it; where autocast has
    one (conv2d), that kernel cast the arguments and excluded autocast for what runs inside. `site` is the stack
    of autocast states of the decompositions running (the outermost caller's: `_call_site`).
    """
    cpp = _has(func, torch._C.DispatchKey.CompositeImplicitAutograd)
    on = cpp and (site[-1] if site else _call_site["autocast"]) and not _has(func, "AutocastCUDA")
    site.append(on)
    before = torch.is_autocast_enabled("cuda")
    torch.set_autocast_enabled("cuda", on)
    try:
        if cpp:
            return func._op_dk(torch._C.DispatchKey.CompositeImplicitAutograd, *args, **kwargs)
        return func.decompose(*args, **kwargs)
    finally:
        torch.set_autocast_enabled("cuda", before)
        site.pop()


class DeviceTrace(TorchDispatchMode):
    """Allocations, frees, kernels and the live-bytes peak of what runs on `device` inside it."""

    def __init__(self, compute_capability: int = 75, device: str = "cuda", cublas_config: str | None = None):
        super().__init__()
        self.cc = compute_capability
        self.workspace_size = cublas_workspace_bytes(compute_capability, cublas_config)   # one per handle
        self.device_type = device
        self.allocator = CachingAllocatorModel()
        self.kernels: list[Kernel] = []
        self.live = self.max_live = 0          # exact storage bytes
        self.tensor_rounded = self.max_tensor_rounded = 0   # in 512 B granules (MemTracker's unit), no cuBLAS workspace
        self.peak: PeakOp | None = None
        self.sdpa_used: dict[str, int] = {}
        self._seen: weakref.WeakSet = weakref.WeakSet()
        self._autocast_site: list[bool] = []     # decompose_as_on_gpu's stack
        self._workspaces: dict[str, int] = {}     # cuBLAS handle ("forward", "autograd") -> allocator handle
        # the allocation stream, for replays with the workspace elsewhere (reserved_by_position):
        # ("m", handle, nbytes), ("f", handle), ("w", handle, nbytes) for the cuBLAS workspace
        self.events: list[tuple] = []

    # -------------------------------------------------------------- public
    @property
    def workspace_bytes(self) -> int:
        """The cuBLAS workspaces held: one per handle that ran a GEMM (see the note above _CUBLAS_GEMMS)."""
        return self.workspace_size * len(self._workspaces)

    def sdpa_backend(self, masked: bool = False, gqa: bool = False) -> str:
        """The attention kernel this GPU runs under the backends enabled now (sdpa_kernel). sdp_utils: flash takes
        no attn_mask (check_for_attn_mask) and grouped heads only on flash and math here (enable_gqa).
        """
        enabled = {"flash": torch.backends.cuda.flash_sdp_enabled(),
                   "efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
                   "math": torch.backends.cuda.math_sdp_enabled(),
                   "cudnn": torch.backends.cuda.cudnn_sdp_enabled()}
        for name in SDPA_PRIORITY:
            if (masked and name == "flash") or (gqa and name in ("efficient", "cudnn")):
                continue
            if enabled[name] and self.cc >= SDPA_KERNELS[name][1]:
                return name
        forced = [n for n, on in enabled.items() if on]
        raise ConfigError(f"no attention kernel: the enabled SDPA backends {forced} need sm_80 or "
                          f"newer and this simulated GPU is sm_{self.cc}; use 'efficient' or 'math'")

    # -------------------------------------------------------------- dispatch
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.scaled_dot_product_attention.default and self.device_type == "cuda":
            with self:
                return self._attention(*args, **kwargs)
        if func.namespace == "aten":
            with self:
                out = decompose_as_on_gpu(self._autocast_site, func, args, kwargs)
            if out is not NotImplemented:
                return out
        out = func(*args, **kwargs)
        self._after(func, args, kwargs, out)           # the output first (structured kernel) ...
        if func.namespace == "aten" and func.__name__.split(".")[0] in _CUBLAS_GEMMS:
            self._cublas_workspace(args)                # ... then cuBLAS's workspace (see _CUBLAS_GEMMS)
        return out

    def mark(self, name: str) -> None:
        """Note a moment in the allocation stream (replay_stats reports the allocated bytes there)."""
        self.events.append(("k", name))

    def reserved_by_position(self) -> dict[str, int]:
        """Max reserved with the cuBLAS workspace at each of WORKSPACE_POSITIONS (the same stream of
        allocations replayed through a fresh allocator model; the first is what the trace ran).
        """
        return {pos: replay_stats(self.events, pos)["max_reserved"] for pos in WORKSPACE_POSITIONS}

    def _attention(self, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                   enable_gqa=False):
        return sdpa_as_on_gpu(self, q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)

    def _cublas_workspace(self, args) -> None:
        """The handle's workspace on its first GEMM: autograd's device thread holds its own handle."""
        if self.device_type != "cuda":
            return
        handle = "autograd" if torch._C._current_graph_task_id() != -1 else "forward"
        if handle not in self._workspaces and any(isinstance(a, torch.Tensor) and a.device.type == "cuda"
                                                  for a in args):
            size = self.workspace_size
            self._workspaces[handle] = self.allocator.malloc(size)   # held for the handle's life
            self.events.append(("w", self._workspaces[handle], size))
            self._add_live(size, PeakOp("cuBLAS workspace", (size,), "uint8"), tensor=False)

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
        self._add_live(nbytes, PeakOp(op, tuple(t.shape), str(t.dtype).replace("torch.", "")))
        return True

    def _add_live(self, nbytes: int, op: PeakOp, tensor: bool = True) -> None:
        self.live += nbytes
        if tensor:
            self.tensor_rounded += round_size(nbytes)
            self.max_tensor_rounded = max(self.max_tensor_rounded, self.tensor_rounded)
        if self.live > self.max_live:
            self.max_live = self.live
            self.peak = op

    def _free(self, handle: int, nbytes: int) -> None:
        self.allocator.free(handle)
        self.events.append(("f", handle))
        self.live -= nbytes
        self.tensor_rounded -= round_size(nbytes)


# modules whose GPU kernels the trace does not run as the GPU does: refused by name before a trace (refuse_unmodelled)
NOT_MODELLED = {
    "RNNBase": "cuDNN's RNN (its weight buffer, workspace and training reserve) is not modelled, and a CPU build "
               "runs another kernel",
    "GRUCell": "its CUDA kernel (_thnn_fused_gru_cell) has no fake kernel in torch: it cannot be traced",
}


def refuse_unmodelled(module: torch.nn.Module) -> None:
    """NotModelled, in one line naming the first module of NOT_MODELLED's kinds (nn.LSTM, nn.GRU, nn.RNN, nn.GRUCell)
    and where it sits, rather than a budget that is wrong or a trace that dies.
    """
    from nblib.errors import NotModelled

    for path, sub in module.named_modules():
        kind = next((k for k in NOT_MODELLED if k in {c.__name__ for c in type(sub).__mro__}), None)
        if kind is not None:
            raise NotModelled(f"nn.{type(sub).__name__} at {path or 'the model itself'}: {NOT_MODELLED[kind]}; "
                              f"not budgeted: measure it on a GPU (torch.cuda.max_memory_reserved())")


def sdpa_as_on_gpu(trace, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """SDPA as aten's scaled_dot_product_attention runs it on the GPU (attention.cpp), after autocast.

    The backend sdp_utils picks on this architecture; for the memory-efficient kernel, the mask as the kernel
    receives it: a boolean mask made additive in q's dtype (convert_boolean_attn_mask), padded to a multiple
    of 8 when its strides are not aligned, then expanded to [B, H, L, S] (preprocess_mask, pad_bias); the
    kernel saves it for backward and, when it requires grad, its backward allocates the gradient at the
    expanded shape, the last dim rounded up to 16 (_efficient_attention_backward's meta). Dropout, causal
    and scale reach the kernel as given. Measured on an H100 (torch 2.11), a [32,4,49,49] fp32 bias under
    fp16 autocast: the fp16 cast and the padded copy in the forward, the [.., 64] fp16 gradient in backward.
    """
    aten = torch.ops.aten
    backend = trace.sdpa_backend(masked=attn_mask is not None, gqa=enable_gqa and q.size(-3) != k.size(-3))
    trace.sdpa_used[backend] = trace.sdpa_used.get(backend, 0) + 1
    mask = attn_mask
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.where(mask, 0.0, torch.scalar_tensor(-math.inf, dtype=q.dtype, device=mask.device))
    if backend == "math":
        return aten._scaled_dot_product_attention_math(q, k, v, mask, dropout_p, is_causal, scale=scale,
                                                       enable_gqa=enable_gqa)[0]
    if backend == "flash":
        return aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, scale=scale)[0]
    lse = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))   # should_compute_logsumexp
    if backend == "cudnn":
        return aten._scaled_dot_product_cudnn_attention(q, k, v, mask, lse, dropout_p, is_causal, scale=scale)[0]
    if mask is not None:
        if mask.stride(-1) != 1 or any(st % 8 for st in mask.stride()[:-1]):     # aligned_tensor<8>
            last = mask.size(-1)
            mask = torch.nn.functional.pad(mask, (0, 8 - last % 8)).narrow(-1, 0, last)     # pad_bias<8>
        mask = mask.expand(q.size(0), q.size(1), q.size(2), k.size(2))
    return aten._scaled_dot_product_efficient_attention(q, k, v, mask, lse, dropout_p, is_causal, scale=scale)[0]


def attention_as_on_gpu(trace):
    """A TorchFunctionMode that runs F.scaled_dot_product_attention as the simulated GPU would.

    With autograd on, SDPA decomposes before a dispatch mode sees it, and a CPU build's backend
    choice is always math; the GPU picks by architecture (a T4: memory-efficient). This calls that
    kernel's aten op (sdpa_as_on_gpu), whose autograd formula saves what the GPU's saves (output and
    logsumexp). While the mode is on, torch.nn.functional.scaled_dot_product_attention is that routing too:
    activation checkpointing recomputes inside backward, where no TorchFunctionMode is active, and the
    recomputation must run the same kernels as the forward (torch.utils.checkpoint counts the saved tensors).
    """
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode

    original = torch._C._nn.scaled_dot_product_attention

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if query.device.type != "cuda":
            return original(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
        with torch._C.DisableTorchFunction():
            if torch.is_autocast_enabled("cuda"):      # SDPA is on autocast's fp16 list: every floating argument
                dtype = torch.get_autocast_dtype("cuda")
                query, key, value = (t.to(dtype) for t in (query, key, value))
                if attn_mask is not None and attn_mask.is_floating_point():
                    attn_mask = attn_mask.to(dtype)
            return sdpa_as_on_gpu(trace, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)

    class AttentionAsOnGPU(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is original:
                return sdpa(*args, **(kwargs or {}))
            return func(*args, **(kwargs or {}))

        def __enter__(self):
            F.scaled_dot_product_attention = sdpa
            return super().__enter__()

        def __exit__(self, *exc):
            F.scaled_dot_product_attention = original
            return super().__exit__(*exc)

    return AttentionAsOnGPU()


def step_trace_class():
    """DeviceTrace that answers a read of a device value (no data on a fake device) with 0, its cuBLAS
    workspace sized by the traced run's CUBLAS_WORKSPACE_CONFIG (set_run_cublas_config).
    """

    scalar = torch.ops.aten._local_scalar_dense.default

    class StepTrace(DeviceTrace):
        def __init__(self, compute_capability: int = 75, device: str = "cuda", cublas_config: str | None = None):
            super().__init__(compute_capability, device, cublas_config or _run["cublas_config"])

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is scalar and getattr(args[0], "constant", None) is None:
                t = args[0]
                return 0.0 if t.dtype.is_floating_point else (False if t.dtype == torch.bool else 0)
            return super().__torch_dispatch__(func, types, args, kwargs)

    return StepTrace


def _flops(func, args, kwargs, out) -> int:
    from torch.utils.flop_counter import flop_registry

    formula = flop_registry.get(func.overloadpacket)
    if formula is None:
        return 0
    return int(formula(*args, **kwargs, out_val=out))
