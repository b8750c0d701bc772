"""What a training checkpoint holds, and the check that a resume continues the same run.

The state is one dict that `torch.save` writes and `torch.load(weights_only=True)` reads back; what it holds
(and why not CUDA's generators): "State" in docs/training.md. `check_identity` refuses a resume whose
identity differs, naming the field, the stored value and the new one.
"""
from __future__ import annotations

import io
import random

import numpy as np
import torch

from nblib.errors import ResumeMismatch
from nblib.units import fmt_repr

STATE_FORMAT = 1


def capture_rng() -> dict:
    """The RNGs a step may draw from before its re-seed: Python, numpy, torch CPU ("State" in docs/training.md)."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {"python": (version, list(internal), gauss),
            "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                      "has_gauss": int(has_gauss), "cached": float(cached)},
            "torch": torch.get_rng_state()}


def restore_rng(state: dict) -> None:
    """Put every RNG back where `capture_rng` found it. The CUDA states an older state holds are not restored:
    the loop re-seeds the CUDA generators before each step, and this machine may have fewer GPUs.
    """
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"]))
    torch.set_rng_state(state["torch"])


def seed_everything(seed: int) -> None:
    """Seed Python, numpy and torch (all devices) for a fresh run."""
    random.seed(seed)
    np.random.seed(seed if seed < 2 ** 32 else [seed & 0xFFFF_FFFF, seed >> 32])  # legacy seeding takes 32 bits
    torch.manual_seed(seed)


def check_identity(stored: dict, current: dict, where: str) -> None:
    """ResumeMismatch naming the first field whose stored value differs from this command's."""
    for key in sorted(set(stored) | set(current)):
        old, new = stored.get(key), current.get(key)
        if isinstance(old, dict) and isinstance(new, dict):
            check_identity(old, new, where)
            continue
        if key == "labels" and old is None:
            continue                  # a state saved before runs recorded their labels: nothing to compare
        if old != new and key == "labels":
            raise ResumeMismatch(
                f"{where} was trained on other labels (label sha256 {str(old)[:12]}..., this command's "
                f"{str(new)[:12]}...): the texts file was edited since, or --texts points at another copy "
                f"(a shuffled one?); pass --texts with the file the run started from, or pass another --out "
                f"to train a new run on these labels")
        if old != new:
            raise ResumeMismatch(
                f"{where} holds a run with {key}={fmt_repr(old, 80)}, this command asks for {key}={fmt_repr(new, 80)}; "
                f"rerun with the original setting to resume, or pass another --out to start a new run")


def check_model(stored: dict, current: dict, where: str) -> None:
    """ResumeMismatch naming what changed when the run's model is not this command's (class, config, weights,
    preprocessing, the output trained, the head); nothing when they are the same model, whatever the spec.
    """
    from nblib.models import identity_changes

    old, new = stored.get("model"), current.get("model")
    if old == new or not any(isinstance(m, dict) and "class" in m for m in (old, new)):
        return                                                  # two TRM shapes: check_identity names the field
    if (stored.get("config") or {}).get("seed") != (current.get("config") or {}).get("seed"):
        return          # a model built from scratch draws its weights from the seed: check_identity names the seed
    if isinstance(old, dict) and isinstance(new, dict) and "class" in old and "class" in new:
        changes = identity_changes(old, new) + [f"{key}: {old.get(key)!r} -> {new.get(key)!r}"
                                                for key in ("output", "head") if old.get(key) != new.get(key)]
        if not changes:
            return
    else:
        changes = [f"{_model_name(old)} -> {_model_name(new)}"]
    raise ResumeMismatch(
        f"{where} trained another model than this command gives ({'; '.join(changes[:6])}): rerun with the run's "
        f"--model (and --output, --weights) to resume, or pass another --out to start a new run")


def _model_name(model) -> str:
    if isinstance(model, dict) and "class" in model:
        return f"model {model['class']}"
    return "the TRM (the default model)" if isinstance(model, dict) else "no model recorded"


def part_bytes(state: dict) -> dict[str, int]:
    """Bytes each part of a train state adds to its checkpoint: its torch.save size less the container's."""
    return {name: max(0, _saved_size(value) - _saved_size(None)) for name, value in state.items()}


def _saved_size(value) -> int:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return len(buffer.getvalue())


