"""The ops torch documents as nondeterministic on CUDA, found in a model's traced training step before its first.

Training runs with strict `torch.use_deterministic_algorithms(True)` (`nblib.train.device.deterministic`) so
that a resume gives the same bytes; on CUDA an op with no deterministic kernel then stops the run with a
RuntimeError at its first call, which nothing on a CPU shows. The table is torch's own: `documented()`
reads the docstring of `torch.use_deterministic_algorithms` in the installed torch (torch/__init__.py; in
2.13 the list "The following normally-nondeterministic operations will throw a RuntimeError when
mode=True"); where it cannot (python -OO, a reworded docstring) it fails closed: it warns, naming torch's
version, and uses the copy shipped as data (`nblib.train.determinism_table`, tested against the docstring).
Each entry's aten kernels are its name in snake case (AdaptiveAvgPool2d ->
adaptive_avg_pool2d), with "when attempting to differentiate" meaning its backward kernel; `KERNELS` holds the
three names that are not so derived, each checked against torch's dispatch in the tests. `documented_in`
reads the kernels of the traced step (`nblib.train.traced`, the same trace as the VRAM budget), and
`check_traced` answers before the first step on CUDA: a refusal naming each op, what will happen and what to
do, or with `NONDETERMINISTIC_ENV`=1 (`train --nondeterministic`) a warning that the resume will not be
bit-identical. An entry whose condition is on an argument the trace does not keep (EmbeddingBag's mode,
scatter_reduce's reduce) is a warning: it may raise.
Named by the docstring, never raised: nn.AdaptiveAvgPool2d to 1x1. aten::adaptive_avg_pool2d has one kernel on
every device, CompositeImplicitAutograd (torchgen/packaged/ATen/native/native_functions.yaml), and for output
1x1 it returns input.mean({-1, -2}) (adaptive_avg_pool2d_symint, ATen/native/AdaptiveAveragePooling.cpp),
whose backward is deterministic; the trace shows `mean`, so transformers' ResNetModel and MobileNetV2Model
(nn.AdaptiveAvgPool2d((1, 1))) train bit-identically on a T4 by construction, and are not named.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import re

from nblib.errors import DeterminismError

log = logging.getLogger("nblib.train")

NONDETERMINISTIC_ENV = "NBLIB_NONDETERMINISTIC"
SECTION = (re.compile(r"will throw a\s+:class:`RuntimeError` when ``mode=True``:"), "In addition")
BULLET = re.compile(r"^\s*\* :(?P<role>class|func):`(?P<name>[^`]+)`(?P<when>.*)$")
MODE = re.compile(r"^\s*- ``(?P<mode>\w+)``")
# documented name -> aten kernel stems where snake case is not the kernel's name: F.interpolate dispatches
# upsample_<mode>*, F.grid_sample grid_sampler_*; NLLLoss: only the 2-d kernel calls alertNotDeterministic
# (aten/src/ATen/native/cuda/NLLLoss2d.cu, nll_loss2d_forward_out_cuda_template, reduction != none), the
# 1-d kernel of a classifier's cross entropy (native/cuda/Loss.cu) does not.
KERNELS = {"torch.nn.functional.interpolate": "upsample_{mode}", "torch.nn.functional.grid_sample": "grid_sampler",
           "torch.nn.NLLLoss": "nll_loss2d"}
DECIDED = ("when attempting to differentiate a CUDA tensor", "when called on a CUDA tensor",
           "when called on CUDA tensor", "and one of the following modes is used:", "and called on a CUDA tensor",
           "and called on CUDA tensor")
DTYPE_CONDITIONS = {"when dtype is floating point or complex": ("float", "complex", "bfloat"),
                    "when called with a quantized tensor": ("q",)}
FIXES = {  # what replaces a documented layer deterministically (offered in the refusal)
    "torch.nn.AdaptiveAvgPool2d": "an adaptive average pool to 1x1 is x.mean((-2, -1), keepdim=True); to another "
                                  "size where the input divides, nn.AvgPool2d(kernel_size=stride=input // output)",
    "torch.nn.AdaptiveMaxPool2d": "an adaptive max pool to 1x1 is x.amax((-2, -1), keepdim=True)",
    "torch.nn.functional.interpolate": "interpolate with mode='nearest', or a learned nn.ConvTranspose2d",
}


def documented() -> list[dict]:
    """torch's list: {name, when (the condition), backward, stems (aten kernel prefixes)}. Read from its docstring;
    where that yields fewer than half the rows of the shipped copy (`nblib.train.determinism_table`: python -OO
    strips docstrings, a reworded one parses to few), the shipped copy, with a warning naming torch's version.
    """
    rows = _table()
    entries = [{"name": name, "role": role, "condition": condition, "modes": list(modes),
                "when": f"{condition} {', '.join(modes)}".strip(), "backward": "differentiate" in condition}
               for name, role, condition, modes in rows]
    for e in entries:
        e["stems"] = _stems(e)
    return entries


@functools.lru_cache(maxsize=1)
def _table() -> tuple:
    """The rows (name, role, condition, modes) of torch's list: its docstring's, else the shipped copy's (fail
    closed: never an empty list because a docstring could not be read).
    """
    import torch

    from nblib.train.determinism_table import DOCUMENTED

    read = read_docstring(torch.use_deterministic_algorithms.__doc__)
    release = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    known = sorted(DOCUMENTED, key=lambda r: tuple(int(p) for p in r.split(".")))
    copy = release if release in DOCUMENTED else known[-1]
    if len(read) * 2 >= len(DOCUMENTED[copy]):
        return read
    log.warning("torch %s: its use_deterministic_algorithms docstring gave %d of the %d ops it documents "
                "(python -OO strips docstrings, or it was reworded); the determinism check uses nblib's copy of "
                "torch %s's list", torch.__version__, len(read), len(DOCUMENTED[copy]), copy)
    return DOCUMENTED[copy]


def read_docstring(text: str | None) -> tuple:
    """The rows (name, role, condition, modes) of the list in torch.use_deterministic_algorithms' docstring (in
    2.13 "The following normally-nondeterministic operations will throw a RuntimeError when mode=True").
    """
    text = text or ""
    start = SECTION[0].search(text)
    body = text[start.end():text.find(SECTION[1], start.end())] if start else ""
    rows: list[list] = []
    for line in body.splitlines():
        bullet, mode = BULLET.match(line), MODE.match(line)
        if bullet:
            rows.append([bullet["name"], bullet["role"], bullet["when"].strip(), []])
        elif mode and rows:
            rows[-1][3].append(mode["mode"])
        elif line.strip() and rows:
            rows[-1][2] = f"{rows[-1][2]} {line.strip()}".strip()
    return tuple((name, role, condition, tuple(modes)) for name, role, condition, modes in rows)


def _stems(entry: dict) -> list[str]:
    leaf = entry["name"].rsplit(".", 1)[-1]
    stem = KERNELS.get(entry["name"]) or (
        re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", leaf).lower() if entry["role"] == "class"
        else leaf)
    return [stem.format(mode=m) for m in entry["modes"]] if "{mode}" in stem else [stem]


def documented_in(kernels) -> list[dict]:
    """The entries of `documented()` that the traced kernels run (`nblib.budget.trace.Kernel`s, or (op, dtype)
    pairs): {op (the aten kernel), name, when, certain (False: an argument condition the trace cannot see)}.
    """
    table, found, seen = documented(), [], set()
    for kernel in kernels:
        op, dtype = (kernel.op, kernel.dtype) if hasattr(kernel, "op") else kernel
        base = op.split(".")[0].lstrip("_")
        for e in table:
            if e["name"] in seen or (e["backward"] and "backward" not in base) or \
                    not any(base.startswith(stem.lstrip("_")) for stem in e["stems"]):
                continue
            rest, dtype_ok = e["condition"], True         # the modes are decided by the kernel's name
            for phrase, prefixes in DTYPE_CONDITIONS.items():
                if phrase in rest:
                    rest, dtype_ok = rest.replace(phrase, ""), dtype_ok and str(dtype).startswith(prefixes)
            if not dtype_ok:
                continue
            for phrase in DECIDED:
                rest = rest.replace(phrase, "")
            seen.add(e["name"])
            found.append({"op": base, "name": e["name"], "when": e["when"], "certain": not rest.strip()})
    return found


@contextlib.contextmanager
def allowed(allow: bool):
    """Within: NBLIB_NONDETERMINISTIC=1 when `allow` (`train --nondeterministic`), the previous value after."""
    before = os.environ.get(NONDETERMINISTIC_ENV)
    if allow:
        os.environ[NONDETERMINISTIC_ENV] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(NONDETERMINISTIC_ENV, None)
        else:
            os.environ[NONDETERMINISTIC_ENV] = before


def opted_out(environ=None) -> bool:
    """True when the run allows nondeterministic kernels (NBLIB_NONDETERMINISTIC=1, `train --nondeterministic`)."""
    return (os.environ if environ is None else environ).get(NONDETERMINISTIC_ENV, "") not in ("", "0")


def check_traced(found: list[dict], spec: str, device: str) -> None:
    """Before the first step on CUDA: DeterminismError naming the ops of `found` (`documented_in`) that will raise,
    unless opted out (then a warning: the resume will not be bit-identical); a warning for those that may.
    """
    sure = [f for f in found if f["certain"]]
    maybe = [f for f in found if not f["certain"]]
    if maybe:
        log.warning("%s: its training step runs %s, which torch documents as nondeterministic on CUDA only %s; "
                    "if so the run stops there (strict deterministic algorithms)", spec,
                    "; ".join(f"{f['name']} ({f['op']})" for f in maybe), "; ".join(f["when"] for f in maybe))
    if not sure:
        return
    ops = "; ".join(f"{f['name']} {f['when']} (aten {f['op']})" for f in sure)
    if opted_out():
        log.warning("%s on %s runs ops torch documents as nondeterministic (%s): %s=1 lets them run, so this run "
                    "and its resume will not be bit-identical", spec, device, ops, NONDETERMINISTIC_ENV)
        return
    fixes = [FIXES[n] for n in dict.fromkeys(f["name"] for f in sure) if n in FIXES]
    layers = "that layer" if len(sure) == 1 else "those layers"
    raise DeterminismError(
        f"{spec} on {device}: its training step runs what torch documents as nondeterministic on CUDA "
        f"(torch.use_deterministic_algorithms): {ops}; training runs torch's strict deterministic algorithms so "
        f"that a resume gives the same bytes, and would stop with a RuntimeError there. Replace {layers}"
        f"{' (' + '; '.join(fixes) + ')' if fixes else ''}, or train with --device cpu, or pass --nondeterministic "
        f"({NONDETERMINISTIC_ENV}=1): it trains, and its resume will NOT be bit-identical")
