"""Where a training run computes, and the switches that keep its bytes reproducible there.

`check_device` and `require_device` are the one check of a device name (a ConfigError, never a traceback);
`deterministic(device)` holds torch's strict deterministic algorithms (with cuBLAS's workspace on CUDA) and
restores the previous switches after; `as_nblib_error` names an op with no deterministic kernel;
`dropout_seed(seed, step, rank)` keys dropout's masks. Why each switch: "On a GPU" in docs/training.md.
Trade-off: strict mode refuses a model with an op that has no deterministic CUDA kernel (instead of training
it irreproducibly); `--nondeterministic` (NBLIB_NONDETERMINISTIC=1) makes the switch warn-only: the run
trains, and its resume is not bit-identical.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import re
import sys

from nblib.errors import ConfigError, DeterminismError

CUBLAS_ENV = "CUBLAS_WORKSPACE_CONFIG"
CUBLAS_DETERMINISTIC = (":4096:8", ":16:8")      # what torch's Context::checkCuBLASConfigDeterministic accepts
DEVICE_FORM = re.compile(r"cpu|cuda(:\d+)?")
CHOICES = "cpu, cuda or cuda:N (the N-th GPU); leave --device out for cuda when a GPU is present, else cpu"


def default_device() -> str:
    """cuda when torch sees a GPU here (without a driver torch is not even imported), else cpu."""
    from nblib import env

    return "cuda" if env.cuda_available() else "cpu"


def check_device(name: str | None) -> str:
    """The device name a run trains on: `name` when it has the form cpu | cuda | cuda:N; None: the default."""
    if name is None:
        return default_device()
    if not isinstance(name, str) or not DEVICE_FORM.fullmatch(name.strip()):
        raise ConfigError(f"train.device={name!r} is not a device training runs on; use {CHOICES}")
    return name.strip()


def require_device(name: str | None) -> str:
    """`check_device`, then what torch knows: a CUDA build, a visible GPU, cuda:N in range (argparse type)."""
    name = check_device(name)
    if not name.startswith("cuda"):
        return name
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        why = (f"this torch build has no CUDA (torch {torch.__version__})" if torch.version.cuda is None
               else "no CUDA GPU is visible to this process (CUDA_VISIBLE_DEVICES, driver)")
        raise ConfigError(f"device {name!r} asked for, but {why}; use --device cpu, or run on a GPU runtime "
                          f"with a CUDA build of torch")
    index = int(name.split(":")[1]) if ":" in name else 0
    if index >= count:
        raise ConfigError(f"device {name!r} asked for, but this machine has {count} CUDA GPU(s) "
                          f"(cuda:0 to cuda:{count - 1}); pass one of them, or --device cuda")
    return name


def ensure_cublas_workspace(environ=None, cuda_initialized: bool | None = None) -> str:
    """Set CUBLAS_WORKSPACE_CONFIG=:4096:8 unless a deterministic value is set; its value.

    Refused (DeterminismError) when CUDA is already initialized in this process with another value:
    torch may have read the variable already, and reads it once.
    """
    environ = os.environ if environ is None else environ
    value = environ.get(CUBLAS_ENV)
    if value in CUBLAS_DETERMINISTIC:
        return value
    if cuda_initialized is None:
        import torch

        cuda_initialized = torch.cuda.is_initialized()
    if cuda_initialized:
        raise DeterminismError(
            f"CUDA was initialized in this process before {CUBLAS_ENV} was set (it is {value!r}); torch reads it "
            f"once, at the first cuBLAS call, so matrix products here may not be reproducible and a resume would "
            f"not be bit-identical: set {CUBLAS_ENV}={CUBLAS_DETERMINISTIC[0]} before the first CUDA call (first "
            f"notebook cell: os.environ['{CUBLAS_ENV}'] = '{CUBLAS_DETERMINISTIC[0]}', or import nblib.train "
            f"first; in a shell: export it) and restart the runtime")
    environ[CUBLAS_ENV] = CUBLAS_DETERMINISTIC[0]
    return CUBLAS_DETERMINISTIC[0]


@contextlib.contextmanager
def deterministic(device: str):
    """Strict deterministic algorithms (and cuDNN autotuning off) inside the block; the old switches after."""
    import torch

    if device.startswith("cuda"):
        ensure_cublas_workspace()
    from .determinism import opted_out

    was = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
           torch.backends.cudnn.benchmark, os.environ.get(INDUCTOR_ENV))
    set_deterministic(torch, True, opted_out())     # warn-only: --nondeterministic (nblib.train.determinism)
    torch.backends.cudnn.benchmark = False
    try:
        yield
    finally:
        set_deterministic(torch, was[0], was[1])
        torch.backends.cudnn.benchmark = was[2]
        if was[3] is None:
            os.environ.pop(INDUCTOR_ENV, None)
        else:
            os.environ[INDUCTOR_ENV] = was[3]


INDUCTOR_ENV = "TORCHINDUCTOR_DETERMINISTIC"


def set_deterministic(torch, mode: bool, warn_only: bool) -> None:
    """torch.use_deterministic_algorithms without importing Inductor (~1 s of torch._dynamo imports).

    torch's own function imports torch._inductor.config to set its `deterministic` flag. Where
    Inductor is loaded already it is called as is; where it is not, the same switch is set and
    Inductor is told through the variable its config reads when it is first imported
    (TORCHINDUCTOR_DETERMINISTIC), so a torch.compile inside the block is deterministic too.
    """
    if "torch._inductor.config" in sys.modules:
        torch.use_deterministic_algorithms(mode, warn_only=warn_only)
        return
    torch._C._set_deterministic_algorithms(mode, warn_only=warn_only)
    if mode:
        os.environ[INDUCTOR_ENV] = "1"


NONDETERMINISTIC = re.compile(r"^\s*(?P<op>\S+) does not have a deterministic implementation")


def as_nblib_error(exc: BaseException, device: str) -> DeterminismError | None:
    """torch's refusal of a non-deterministic op (or of cuBLAS's workspace) as a DeterminismError; else None."""
    text = str(exc)
    match = NONDETERMINISTIC.search(text)
    if match:
        return DeterminismError(
            f"{match['op']} has no deterministic kernel on {device} in this torch, and training runs with "
            f"torch.use_deterministic_algorithms(True) so that a resume gives the same bytes: replace the layer "
            f"that calls it in the model, or train on --device cpu (where it may have one), or pass "
            f"--nondeterministic: it trains, and its resume will NOT be bit-identical")
    if CUBLAS_ENV in text and "Deterministic behavior was enabled" in text:
        return DeterminismError(
            f"torch read {CUBLAS_ENV} before training set it (a cuBLAS call ran earlier in this process): set "
            f"{CUBLAS_ENV}={CUBLAS_DETERMINISTIC[0]} before the first CUDA call and restart the runtime")
    return None


def dropout_seed(seed: int, step: int, rank: int) -> int:
    """The seed of torch's generator for `step` on `rank`: one stream per (seed, step, rank), in [0, 2^63)."""
    digest = hashlib.sha256(f"nblib.train.dropout:{seed}:{step}:{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1
