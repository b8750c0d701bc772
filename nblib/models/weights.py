"""Weights in and out of any torch module: safetensors or a torch state dict, loaded strictly.

A weights file is read by what it holds, not its suffix: a safetensors file (8-byte header length,
then a JSON header) or a torch file read with `weights_only=True` (no pickled code runs). A torch
file may hold the state dict itself or `{"state_dict": ..., "config": ...}` (what
`TRMVisionEncoder.save_weights` writes). The load is strict: a missing or unexpected key, or a
tensor of another shape, is a WeightsError that names them, before any weight is changed.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

from nblib.atomic import atomic_torch_save, atomic_write_bytes
from nblib.errors import MissingDependency, WeightsError

_SHOWN = 5


def read_weights(path: str | Path) -> tuple[dict, dict | None]:
    """(state dict, the config saved beside it or None) from a safetensors or torch weights file."""
    import torch

    path = Path(path)
    if not path.is_file():
        what = "is a folder" if path.is_dir() else "does not exist"
        raise WeightsError(f"weights {path} {what}: pass a safetensors or torch state-dict file, or leave "
                           f"--weights out to use the model's seeded initial weights")
    if _is_safetensors(path):
        return _read_safetensors(path), None
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:   # noqa: BLE001 - torch.load fails on garbage with many types
        raise WeightsError(f"weights {path} ({path.stat().st_size:,} bytes) is neither a safetensors file nor "
                           f"a torch state dict ({type(exc).__name__}: {str(exc)[:200]}); save the weights with "
                           f"safetensors.torch.save_file or torch.save(model.state_dict())") from None
    saved_config = None
    if isinstance(payload, dict) and isinstance(payload.get("state_dict"), dict):
        saved_config = payload.get("config") if isinstance(payload.get("config"), dict) else None
        payload = payload["state_dict"]
    bad = [k for k, v in payload.items() if not isinstance(v, torch.Tensor)] if isinstance(payload, dict) else None
    if bad is None or bad:
        what = type(payload).__name__ if bad is None else f"non-tensor entries {bad[:_SHOWN]}"
        raise WeightsError(f"weights {path} holds {what}, not a state dict of tensors; save "
                           f"model.state_dict() (or {{'state_dict': model.state_dict()}})")
    return payload, saved_config


def load_weights(module, path: str | Path, trm_config: dict | None = None):
    """Load a weights file into `module` strictly; returns the module. WeightsError names what differs.

    trm_config: the TRM's config; weights saved with another one (`TRMVisionEncoder.save_weights`) are refused.
    """
    state, saved_config = read_weights(path)
    if trm_config is not None and saved_config is not None and saved_config != trm_config:
        raise WeightsError(f"weights in {path} are for TRM {saved_config}, this model is "
                           f"{trm_config}; build it with the config the weights came from")
    check_state_dict(module, state, where=str(path))
    try:
        module.load_state_dict(state, strict=True)
    except RuntimeError as exc:    # dtype casts torch refuses; keys and shapes were checked above
        raise WeightsError(f"weights in {path} do not load into {type(module).__name__}: "
                           f"{str(exc)[:300]}") from None
    return module


def check_state_dict(module, state: dict, where: str = "the state dict") -> None:
    """WeightsError naming the missing keys, the unexpected keys and the shape mismatches (none: returns)."""
    expected = module.state_dict()
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    shapes = [f"{k} {list(state[k].shape)} (model: {list(v.shape)})" for k, v in expected.items()
              if k in state and tuple(state[k].shape) != tuple(v.shape)]
    if not (missing or unexpected or shapes):
        return
    parts = []
    for label, keys in (("missing", missing), ("unexpected", unexpected), ("of another shape", shapes)):
        if keys:
            more = f" and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else ""
            parts.append(f"{len(keys)} {label}: {', '.join(keys[:_SHOWN])}{more}")
    raise WeightsError(f"weights in {where} do not fit {type(module).__name__} "
                       f"({len(expected)} tensors): {'; '.join(parts)}. Pass the weights of this model "
                       f"(same class and config), or the --model they were saved from")


def save_weights(module, path: str | Path) -> Path:
    """Write `module`'s state dict atomically: safetensors for a .safetensors path, else torch.save."""
    path = Path(path)
    state = {k: v.detach().cpu().contiguous() for k, v in module.state_dict().items()}
    if path.suffix == ".safetensors":
        safetensors_torch = _safetensors()
        # tied weights share storage: safetensors refuses shared tensors, so each entry gets its own copy
        state = {k: v.clone() for k, v in state.items()}
        return atomic_write_bytes(path, safetensors_torch.save(state)).path
    return atomic_torch_save(state, path).path


def weights_sha256(module, *, typed: bool = True) -> str:
    """sha256 over every parameter and buffer (name, dtype, shape, bytes), in name order.

    typed=False hashes each name and its bytes only: the TRM's fingerprint that encode run manifests record
    under "weights" (`EncodeModel.fingerprints`), kept so runs started before the model contract still resume.
    """
    import torch

    h = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        t = tensor.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{list(t.shape)}|".encode() if typed else name.encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _is_safetensors(path: Path) -> bool:
    with open(path, "rb") as f:
        head = f.read(9)
    if len(head) < 9:
        return False
    header_len = int.from_bytes(head[:8], "little")
    return head[8:9] == b"{" and 0 < header_len <= path.stat().st_size - 8


def _read_safetensors(path: Path) -> dict:
    safetensors_torch = _safetensors()
    try:
        return safetensors_torch.load_file(str(path), device="cpu")
    except Exception as exc:   # noqa: BLE001 - SafetensorError and friends
        raise WeightsError(f"weights {path} looks like a safetensors file but does not read as one "
                           f"({type(exc).__name__}: {str(exc)[:200]}); write it again") from None


def _safetensors():
    try:
        import safetensors.torch as safetensors_torch
    except ImportError:
        raise MissingDependency("safetensors is not installed: pip install safetensors==0.8.0 "
                                "(or save the weights with torch.save and a .pt suffix)") from None
    return safetensors_torch
