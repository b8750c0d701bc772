"""Autocast in the trace is the GPU's, op by op, in training and under inference_mode (issue 49).

torch's own CUDA autocast lists (the installed torch's ATen/autocast_mode.h: the fp16 casts, the fp32 ops, the
fp32-with-dtype ops, the promotions) are walked through the trace (nblib.budget.trace: fake cuda:0, DeviceTrace),
each op at the dtypes autocast's CUDA rules give. So are the composites that reach the trace whole under
inference_mode because autocast has no kernel of their own (a `padding="same"` convolution, `F.interpolate`,
`F.cross_entropy`): on the GPU their inner calls pass through autocast; the trace used to run them below it.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import traceable_models

HERE = Path(__file__).parent
POLICIES = {"AT_FORALL_LOWER_PRECISION_FP": "fp16", "AT_FORALL_FP32": "fp32",
            "AT_FORALL_FP32_SET_OPT_DTYPE": "fp32", "AT_FORALL_PROMOTE": "promote"}
# registered by autocast_mode.cpp itself, not through the header's lists: cuDNN's convolutions (fp16), the two
# norm overloads of AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE (fp32), binary_cross_entropy (banned: an error)
IN_THE_CPP = {"cudnn_convolution": "fp16", "cudnn_convolution_transpose": "fp16", "norm.Scalar": "fp32",
              "norm.ScalarOpt_dim": "fp32", "binary_cross_entropy": "banned"}
# ops of the lists this torch cannot run on a fake device (no meta kernel or fake impl: FakeTensorMode falls back
# to a real CUDA kernel, which a CPU build has not); no module of nn calls the first two, and nn.GRU / nn.GRUCell
# (the others) are refused by the budget before any trace (nblib.budget.model_vram)
NO_FAKE_KERNEL = {"cudnn_convolution", "cudnn_convolution_transpose", "_thnn_fused_gru_cell", "gru_cell"}


def autocast_lists() -> dict[str, str]:
    """{op (name or name.overload): "fp16" | "fp32" | "promote"}, parsed from the installed torch's header."""
    import torch

    text = (Path(torch.__file__).parent / "include" / "ATen" / "autocast_mode.h").read_text(encoding="utf-8")
    ops = {}
    for macro, policy in POLICIES.items():
        body = re.search(rf"#define {macro}\(_\)((?:.*\\\n)*.*\n)", text).group(1)
        for name, overload in re.findall(r"_\((\w+)(?:,\s*(\w+))?\)", body):
            ops[f"{name}.{overload}" if overload else name] = policy
    return ops


def test_the_lists_are_what_this_torch_registers_for_cuda_autocast():
    """The parsed lists, with the five ops autocast_mode.cpp registers itself, are every op with a CUDA autocast
    kernel in this torch: none missed, none invented.
    """
    import torch

    registered = {n.removeprefix("aten::") for n in torch._C._dispatch_get_all_op_names()
                  if torch._C._dispatch_has_kernel_for_dispatch_key(n, "AutocastCUDA")}
    parsed = autocast_lists()
    assert len(parsed) > 100
    assert set(parsed) | set(IN_THE_CPP) == registered


def _calls(t, i, aten, nnf):
    """{op: a call of it on fake cuda tensors made by t(*shape, dtype) (float) and i(*shape, high) (int64)}."""
    x2, x4 = (lambda d: t(4, 4, dtype=d)), (lambda d: t(2, 4, 6, 6, dtype=d))
    unary = {n: (lambda d, n=n: getattr(aten, n)(t(4, 4, dtype=d))) for n in (
        "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
        "sinh", "tan", "prod", "sum", "linalg_vector_norm", "pdist", "nuclear_norm")}
    up = {n: (lambda d, n=n, x=x, s=s: getattr(aten, n)(x(d), s, False)) for n, x, s in (
        ("upsample_linear1d", lambda d: t(2, 4, 6, dtype=d), [12]), ("upsample_bilinear2d", x4, [12, 12]),
        ("_upsample_bilinear2d_aa", x4, [12, 12]), ("upsample_bicubic2d", x4, [12, 12]),
        ("_upsample_bicubic2d_aa", x4, [12, 12]),
        ("upsample_trilinear3d", lambda d: t(1, 2, 3, 3, 3, dtype=d), [6, 6, 6]))}
    near = {n: (lambda d, n=n, x=x, s=s: getattr(aten, n)(x(d), s)) for n, x, s in (
        ("upsample_nearest1d", lambda d: t(2, 4, 6, dtype=d), [12]),
        ("_upsample_nearest_exact1d", lambda d: t(2, 4, 6, dtype=d), [12]), ("upsample_nearest2d", x4, [12, 12]),
        ("_upsample_nearest_exact2d", x4, [12, 12]),
        ("upsample_nearest3d", lambda d: t(1, 2, 3, 3, 3, dtype=d), [6, 6, 6]),
        ("_upsample_nearest_exact3d", lambda d: t(1, 2, 3, 3, 3, dtype=d), [6, 6, 6]))}
    w, b = (lambda d: t(8, 4, 3, 3, dtype=d)), (lambda d: t(8, dtype=d))
    wt = lambda d: t(4, 8, 3, 3, dtype=d)          # noqa: E731 (transposed: [in, out, kh, kw])
    cell = lambda op, k: lambda d: op(t(3, 4, dtype=d), *([[t(3, 5, dtype=d)] * 2] if k == 4 else [t(3, 5, dtype=d)]),  # noqa: E731,E501
                                      t(k * 5, 4, dtype=d), t(k * 5, 5, dtype=d), t(k * 5, dtype=d), t(k * 5, dtype=d))
    fp16 = {
        "_convolution.deprecated": lambda d: aten._convolution.deprecated(
            x4(d), w(d), b(d), [1, 1], [1, 1], [1, 1], False, [0, 0], 1, False, False, True),
        "_convolution": lambda d: aten._convolution(x4(d), w(d), b(d), [1, 1], [1, 1], [1, 1], False, [0, 0], 1,
                                                    False, False, True, True),
        "conv1d": lambda d: aten.conv1d(t(2, 4, 6, dtype=d), t(8, 4, 3, dtype=d)),
        "conv2d": lambda d: aten.conv2d(x4(d), w(d), b(d)),
        "conv3d": lambda d: aten.conv3d(t(1, 4, 3, 3, 3, dtype=d), t(8, 4, 1, 1, 1, dtype=d)),
        "conv_tbc": lambda d: aten.conv_tbc(t(6, 2, 4, dtype=d), t(3, 4, 8, dtype=d), b(d), 1),
        "conv_transpose1d": lambda d: aten.conv_transpose1d(t(2, 4, 6, dtype=d), t(4, 8, 3, dtype=d)),
        "conv_transpose2d.input": lambda d: aten.conv_transpose2d.input(x4(d), wt(d)),
        "conv_transpose3d.input": lambda d: aten.conv_transpose3d.input(t(1, 4, 3, 3, 3, dtype=d),
                                                                        t(4, 8, 1, 1, 1, dtype=d)),
        "convolution": lambda d: aten.convolution(x4(d), w(d), b(d), [1, 1], [1, 1], [1, 1], False, [0, 0], 1),
        "prelu": lambda d: aten.prelu(x4(d), t(4, dtype=d)),
        "addmm": lambda d: aten.addmm(x2(d), x2(d), x2(d)), "addmv": lambda d: aten.addmv(t(4, dtype=d), x2(d),
                                                                                          t(4, dtype=d)),
        "addr": lambda d: aten.addr(x2(d), t(4, dtype=d), t(4, dtype=d)), "matmul": lambda d: aten.matmul(x2(d), x2(d)),
        "einsum": lambda d: aten.einsum("ij,jk->ik", [x2(d), x2(d)]), "mm": lambda d: aten.mm(x2(d), x2(d)),
        "mv": lambda d: aten.mv(x2(d), t(4, dtype=d)), "linalg_vecdot": lambda d: aten.linalg_vecdot(x2(d), x2(d)),
        "linear": lambda d: aten.linear(x2(d), x2(d), t(4, dtype=d)),
        "addbmm": lambda d: aten.addbmm(x2(d), t(2, 4, 4, dtype=d), t(2, 4, 4, dtype=d)),
        "baddbmm": lambda d: aten.baddbmm(t(2, 4, 4, dtype=d), t(2, 4, 4, dtype=d), t(2, 4, 4, dtype=d)),
        "bmm": lambda d: aten.bmm(t(2, 4, 4, dtype=d), t(2, 4, 4, dtype=d)),
        "chain_matmul": lambda d: aten.chain_matmul([x2(d), x2(d), x2(d)]),
        "linalg_multi_dot": lambda d: aten.linalg_multi_dot([x2(d), x2(d), x2(d)]),
        "_thnn_fused_lstm_cell": lambda d: aten._thnn_fused_lstm_cell(t(3, 20, dtype=d), t(3, 20, dtype=d),
                                                                      t(3, 5, dtype=d), t(20, dtype=d), t(20, dtype=d)),
        "_thnn_fused_gru_cell": lambda d: aten._thnn_fused_gru_cell(t(3, 15, dtype=d), t(3, 15, dtype=d),
                                                                    t(3, 5, dtype=d)),
        "lstm_cell": cell(aten.lstm_cell, 4), "gru_cell": cell(aten.gru_cell, 3),
        "rnn_tanh_cell": cell(aten.rnn_tanh_cell, 1), "rnn_relu_cell": cell(aten.rnn_relu_cell, 1),
        "_scaled_dot_product_flash_attention": lambda d: aten._scaled_dot_product_flash_attention(
            *(t(1, 2, 8, 16, dtype=d) for _ in range(3)))[0],
        "scaled_dot_product_attention": lambda d: aten.scaled_dot_product_attention(
            *(t(1, 2, 8, 16, dtype=d) for _ in range(3))),
        "cudnn_convolution": lambda d: aten.cudnn_convolution(x4(d), w(d), [1, 1], [1, 1], [1, 1], 1, False, False,
                                                              True),
        "cudnn_convolution_transpose": lambda d: aten.cudnn_convolution_transpose(
            x4(d), wt(d), [1, 1], [0, 0], [1, 1], [1, 1], 1, False, False, True),
    }
    fp32 = {
        **unary, **up, **near,
        "pow.Tensor_Scalar": lambda d: aten.pow.Tensor_Scalar(x2(d), 2), "pow.Tensor_Tensor": lambda d: aten.pow.
        Tensor_Tensor(x2(d), x2(d)), "pow.Scalar": lambda d: aten.pow.Scalar(2, x2(d)),
        "softplus": lambda d: aten.softplus(x2(d)), "layer_norm": lambda d: aten.layer_norm(x2(d), [4]),
        "native_layer_norm": lambda d: aten.native_layer_norm(x2(d), [4], t(4, dtype=d), t(4, dtype=d), 1e-5)[0],
        "rms_norm": lambda d: aten.rms_norm(x2(d), [4]), "group_norm": lambda d: aten.group_norm(x4(d), 2),
        "frobenius_norm.dim": lambda d: aten.frobenius_norm.dim(x2(d), [1]),
        "nuclear_norm.dim": lambda d: aten.nuclear_norm.dim(x2(d), [0, 1]),
        "cosine_similarity": lambda d: aten.cosine_similarity(x2(d), x2(d)),
        "poisson_nll_loss": lambda d: aten.poisson_nll_loss(x2(d), x2(d), True, False, 1e-8, 1),
        "cosine_embedding_loss": lambda d: aten.cosine_embedding_loss(x2(d), x2(d), t(4, dtype=d)),
        "nll_loss": lambda d: aten.nll_loss(x2(d), i(4, high=4)),
        "nll_loss2d": lambda d: aten.nll_loss2d(x4(d), i(2, 6, 6, high=4)),
        "hinge_embedding_loss": lambda d: aten.hinge_embedding_loss(x2(d), x2(d)),
        "kl_div": lambda d: aten.kl_div(x2(d), x2(d)), "l1_loss": lambda d: aten.l1_loss(x2(d), x2(d)),
        "smooth_l1_loss": lambda d: aten.smooth_l1_loss(x2(d), x2(d)),
        "huber_loss": lambda d: aten.huber_loss(x2(d), x2(d)), "mse_loss": lambda d: aten.mse_loss(x2(d), x2(d)),
        "margin_ranking_loss": lambda d: aten.margin_ranking_loss(x2(d), x2(d), x2(d)),
        "multilabel_margin_loss": lambda d: aten.multilabel_margin_loss(x2(d), i(4, 4, high=4)),
        "soft_margin_loss": lambda d: aten.soft_margin_loss(x2(d), x2(d).detach()),
        "triplet_margin_loss": lambda d: aten.triplet_margin_loss(x2(d), x2(d), x2(d)),
        "multi_margin_loss": lambda d: aten.multi_margin_loss(x2(d), i(4, high=4)),
        "binary_cross_entropy_with_logits": lambda d: aten.binary_cross_entropy_with_logits(x2(d), x2(d)),
        "dist": lambda d: aten.dist(x2(d), x2(d)), "cdist": lambda d: aten.cdist(x2(d), x2(d)),
        "renorm": lambda d: aten.renorm(x2(d), 2, 0, 1.0), "logsumexp": lambda d: aten.logsumexp(x2(d), [1]),
        "prod.dim_int": lambda d: aten.prod.dim_int(x2(d), 1), "softmax.int": lambda d: aten.softmax.int(x2(d), 1),
        "log_softmax.int": lambda d: aten.log_softmax.int(x2(d), 1), "cumprod": lambda d: aten.cumprod(x2(d), 1),
        "cumsum": lambda d: aten.cumsum(x2(d), 1), "linalg_matrix_norm": lambda d: aten.linalg_matrix_norm(x2(d), 1),
        "linalg_matrix_norm.str_ord": lambda d: aten.linalg_matrix_norm.str_ord(x2(d), "fro"),
        "sum.dim_IntList": lambda d: aten.sum.dim_IntList(x2(d), [1]),
        "norm.Scalar": lambda d: aten.norm.Scalar(x2(d)), "norm.ScalarOpt_dim": lambda d: aten.norm.ScalarOpt_dim(
            x2(d), 2, [1]),
    }
    v = lambda d: t(4, dtype=d)                     # noqa: E731
    promote = {  # the first float argument in one dtype, the others in the other
        "addcdiv": lambda d, e: aten.addcdiv(x2(d), x2(e), x2(e)), "addcmul": lambda d, e: aten.addcmul(
            x2(d), x2(e), x2(e)), "atan2": lambda d, e: aten.atan2(x2(d), x2(e)),
        "bilinear": lambda d, e: aten.bilinear(x2(d), x2(e), t(3, 4, 4, dtype=e), t(3, dtype=e)),
        "cross": lambda d, e: aten.cross(t(2, 3, dtype=d), t(2, 3, dtype=e)),
        "dot": lambda d, e: aten.dot(v(d), v(e)), "vdot": lambda d, e: aten.vdot(v(d), v(e)),
        "grid_sampler": lambda d, e: aten.grid_sampler(x4(d), t(2, 3, 3, 2, dtype=e), 0, 0, False),
        "index_put": lambda d, e: aten.index_put(x2(d), [i(2, high=4)], t(2, 4, dtype=e)),
        "tensordot": lambda d, e: aten.tensordot(x2(d), x2(e), [1], [0]),
        "scatter_add": lambda d, e: aten.scatter_add(x2(d), 0, i(4, 4, high=4), x2(e)),
    }
    composites = {  # no CUDA autocast kernel of their own: what they call has one
        'F.conv1d(padding="same")': ("fp16", lambda d: nnf.conv1d(t(2, 4, 6, dtype=d), t(8, 4, 3, dtype=d),
                                                                padding="same")),
        'F.conv2d(padding="same")': ("fp16", lambda d: nnf.conv2d(x4(d), w(d), b(d), padding="same")),
        'F.conv2d(padding="valid")': ("fp16", lambda d: nnf.conv2d(x4(d), w(d), b(d), padding="valid")),
        'F.conv3d(padding="same")': ("fp16", lambda d: nnf.conv3d(t(1, 4, 3, 3, 3, dtype=d),
                                                                t(8, 4, 3, 3, 3, dtype=d), padding="same")),
        'depthwise nnf.conv2d(padding="same")': ("fp16", lambda d: nnf.conv2d(x4(d), t(4, 1, 3, 3, dtype=d),
                                                                          padding="same", groups=4)),
        'F.interpolate(bilinear)': ("fp32", lambda d: nnf.interpolate(x4(d), scale_factor=2, mode="bilinear")),
        'F.interpolate(nearest)': ("fp32", lambda d: nnf.interpolate(x4(d), scale_factor=2)),
        'F.interpolate(bicubic)': ("fp32", lambda d: nnf.interpolate(x4(d), size=(9, 9), mode="bicubic")),
        'F.cross_entropy': ("fp32", lambda d: nnf.cross_entropy(x2(d), i(4, high=4))),
    }
    return fp16, fp32, promote, composites


def _walk() -> dict:
    """In a process with the fake-CUDA shim: {mode: {op: [policy, dtype of the output or the error]}}."""
    import torch
    import torch.nn.functional as F

    from nblib.budget.trace import DeviceTrace, fake_cuda

    lists, out = autocast_lists(), {}
    for mode in ("training", "inference_mode"):
        got = out[mode] = {}
        with fake_cuda():
            def t(*shape, dtype, grad=mode == "training"):
                return torch.randn(shape, device="cuda", dtype=dtype, requires_grad=grad)

            def i(*shape, high):
                return torch.randint(0, high, shape, device="cuda")

            fp16, fp32, promote, composites = _calls(t, i, torch.ops.aten, F)
            calls = {**{op: ("fp16", lambda c=c: c(torch.float32)) for op, c in fp16.items()},
                     **{op: ("fp32", lambda c=c: c(torch.float16)) for op, c in fp32.items()},
                     **{op: ("promote", lambda c=c: (c(torch.float16, torch.float32), c(torch.float32,
                                                                                        torch.float16)))
                        for op, c in promote.items()},
                     **{op: (p, lambda c=c, p=p: c(torch.float32 if p == "fp16" else torch.float16))
                        for op, (p, c) in composites.items()}}
            for op, (policy, call) in calls.items():
                grad = torch.inference_mode() if mode == "inference_mode" else torch.enable_grad()
                try:
                    with DeviceTrace(), grad, torch.autocast("cuda", dtype=torch.float16):
                        res = call()
                    dtype = ",".join(str(r.dtype).removeprefix("torch.") for r in
                                     (res if isinstance(res, tuple) else (res,)))
                except Exception as exc:  # noqa: BLE001 (reported, and the test names it)
                    dtype = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
                got[op] = [lists.get(op, IN_THE_CPP.get(op, "composite " + policy)), dtype]
    return out


@pytest.fixture(scope="module")
def walked():
    from nblib.budget.shim import backward_capability, shim_path

    ok, why = backward_capability()
    if not ok:
        pytest.skip(why)
    code = (f"import ctypes, json, sys; ctypes.CDLL({str(shim_path())!r}); sys.path.insert(0, {str(HERE)!r}); "
            "from test_autocast_trace import _walk; print(json.dumps(_walk()))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


EXPECTED = {"fp16": "float16", "fp32": "float32", "promote": "float32"}


@pytest.mark.parametrize("mode", ["training", "inference_mode"])
def test_every_listed_op_comes_out_of_the_trace_as_cuda_autocast_casts_it(walked, mode):
    """fp16 list: fp32 in, fp16 out; fp32 and fp32-with-dtype lists: fp16 in, fp32 out; promotions: fp16 and fp32
    in (either order), fp32 out; and the composites (padding="same" convolutions among them) as what they call.
    Every op of torch's lists is called, none skipped; those with no fake kernel fail as only that.
    """
    got = walked[mode]
    assert set(autocast_lists()) | set(IN_THE_CPP) - {"binary_cross_entropy"} <= set(got)
    wrong = {op: dtype for op, (policy, dtype) in got.items() if op not in NO_FAKE_KERNEL
             and set(dtype.split(",")) != {EXPECTED[policy.removeprefix("composite ")]}}
    assert not wrong, wrong
    assert all("Torch not compiled with CUDA enabled" in got[op][1] for op in NO_FAKE_KERNEL)


EFFICIENT = '''
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, c, pad):
        super().__init__()
        p = (lambda k: "same") if pad == "same" else (lambda k: k // 2)
        self.expand = nn.Conv2d(c, 4 * c, 1, padding=p(1), bias=False)
        self.bn1 = nn.BatchNorm2d(4 * c)
        self.depthwise = nn.Conv2d(4 * c, 4 * c, 5, padding=p(5), groups=4 * c, bias=False)
        self.bn2 = nn.BatchNorm2d(4 * c)
        self.project = nn.Conv2d(4 * c, c, 1, padding=p(1), bias=False)
        self.bn3 = nn.BatchNorm2d(c)

    def forward(self, x):
        h = nn.functional.silu(self.bn1(self.expand(x)))
        h = nn.functional.silu(self.bn2(self.depthwise(h)))
        return x + self.bn3(self.project(h))


class TinyEff(nn.Module):
    """EfficientNet-like: a stem conv, MBConv blocks (1x1 expand, 5x5 depthwise, 1x1 project, BatchNorm, SiLU)."""

    preprocessing = {"size": [64, 64], "interpolation": "bilinear"}
    pad = "same"

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding="same" if self.pad == "same" else 1)
        self.blocks = nn.Sequential(*(Block(16, self.pad) for _ in range(3)))

    def forward(self, x):
        return {"pooled": self.blocks(nn.functional.silu(self.stem(x))).mean((2, 3))}


class TinyEffInt(TinyEff):
    """The same with integer padding (k // 2): what `padding="same"` is for these odd kernels at stride 1."""

    pad = "int"
'''


@pytest.fixture(scope="module")
def efficient(tmp_path_factory):
    with traceable_models(tmp_path_factory, EFFICIENT) as folder:
        yield folder


def test_an_efficientnet_like_encode_budget_is_its_integer_padded_twins(efficient, monkeypatch):
    """`padding="same"` convolutions (the stem, 1x1 expand/project, 5x5 depthwise; BatchNorm and SiLU between) under
    inference_mode and fp16 autocast: the budget equals the same model with `padding=k // 2`, which autocast casts
    through conv2d's own kernel. It was 1.33x that (2.25x less the CUDA context: fp32 activations), its largest
    batch 2,836 where 4,096 fit.
    """
    from nblib.budget.model_vram import model_vram

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(efficient), os.environ.get("PYTHONPATH")) if p))
    same, integer = (model_vram(f"tinyfactory:{name}", 64) for name in ("TinyEff", "TinyEffInt"))
    assert [(ln.name, ln.bytes) for ln in same.lines] == [(ln.name, ln.bytes) for ln in integer.lines]
    assert same.largest_batch == integer.largest_batch
