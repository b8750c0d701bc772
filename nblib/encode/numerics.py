"""The numerics a run encodes with: device type, the precision actually used, torch and CUDA versions.

Two processes with the same settings and weights still write different bytes when they encode with other
numerics (fp16 autocast on a T4 against fp32 on a CPU runtime, or another torch or CUDA build), so each
part's meta and the run manifest record them, and a resume with other ones is refused, naming the change,
unless the parts are re-encoded (`reencode_numerics=True`, `--reencode-numerics`: docs/failures.md).
Trade-off: a torch upgrade between two sessions also counts as a change.
"""
from __future__ import annotations

from nblib.errors import ResumeMismatch

__all__ = ["KEY", "PRECISIONS", "identity_of", "numerics_changes", "numerics_of", "part_is_current",
           "refuse_other_numerics", "resolved_precision"]

KEY = "numerics"   # the key under a run's fingerprints and each part's meta fingerprints
PRECISIONS = ("auto", "fp32", "fp16", "bf16")   # nblib.trm.PRECISIONS, here without importing torch


def resolved_precision(precision: str, device_type: str) -> str:
    """The precision an encoder's "auto" really runs: fp16 autocast on CUDA, fp32 on the CPU."""
    if precision == "auto":
        return "fp16" if device_type == "cuda" else "fp32"
    return precision


def numerics_of(device, precision: str = "auto") -> dict:
    """What decides the bytes beside the settings: device type, precision used, torch and CUDA versions."""
    import torch

    kind = getattr(device, "type", str(device))
    return {"device": kind, "precision": resolved_precision(precision, kind), "torch": torch.__version__,
            "cuda": torch.version.cuda}


def numerics_changes(old: dict, new: dict) -> list[str]:
    """'precision fp16 -> fp32', 'device cuda -> cpu', ... for every numerics field that differs."""
    order = ("precision", "device", "torch", "cuda")
    keys = [k for k in order if k in old or k in new] + sorted(set(old) | set(new) - set(order))
    return [f"{k} {old.get(k)} -> {new.get(k)}" for k in keys if old.get(k) != new.get(k)]


def refuse_other_numerics(old: dict | None, new: dict, where: str, n_parts: int | None = None) -> None:
    """ResumeMismatch naming what changed when `old` numerics (recorded) differ from `new` (this process)."""
    if not old or old == new:
        return
    changes = "; ".join(numerics_changes(old, new))
    parts = f"its {n_parts} durable parts" if n_parts is not None else "its durable parts"
    raise ResumeMismatch(
        f"{changes}: this run was started on {old.get('device')} ({where}); resuming here would mix two "
        f"numerics in one output. Resume on the hardware and precision it was started with (--device, "
        f"--precision), or pass --reencode-numerics (reencode_numerics=True) to re-encode {parts} made "
        f"with other numerics")


def identity_of(fingerprints: dict) -> dict:
    """The run's identity without its numerics: what its lock and its mirror folder's claim name.

    A run resumed on other hardware is still the same run there (its numerics are checked apart).
    """
    return {k: v for k, v in fingerprints.items() if k != KEY}


def part_is_current(meta: dict, mine: dict | None, reencode: bool) -> bool:
    """Whether a durable part was made with this process's numerics.

    A part of other numerics is refused (ResumeMismatch naming the change), or with `reencode`
    counted as not durable so it is encoded again. A part that records none (made before the
    numerics were recorded) is taken as it is.
    """
    theirs = meta.get("fingerprints", {}).get(KEY)
    if not theirs or not mine or theirs == mine:
        return True
    if not reencode:
        refuse_other_numerics(theirs, mine, f"part {meta.get('name')}")
    return False
