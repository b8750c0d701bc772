"""What a run's model is, as data: class, config, a hash of the weights, the preprocessing fingerprint.

A run records `model_identity(...)` when it starts; a resume compares the model it was given with
the record (`identity_changes`) and refuses a different one, naming each part that changed (the
class, each config key, the weights, each preprocessing field). The spec string is recorded for
the message but is not compared: the same model reached by another spec is the same model.
"""
from __future__ import annotations

import dataclasses
import json

from nblib.models.preprocessing import Preprocessing
from nblib.models.weights import weights_sha256
from nblib.units import fmt_repr

_VOLATILE_CONFIG_KEYS = ("transformers_version", "_name_or_path")
_SHOWN = 6


def model_identity(model, spec: str, preprocessing: Preprocessing, config: dict | None = None) -> dict:
    """The identity of `model` (an nn.Module) as JSON-able data; `config` defaults to what the module carries."""
    if config is None:
        config = module_config(model)
    cls = type(model)
    return {"spec": spec, "class": f"{cls.__module__}.{cls.__qualname__}", "config": config,
            "weights_sha256": weights_sha256(model), "parameters": sum(p.numel() for p in model.parameters()),
            "preprocessing": {"fingerprint": preprocessing.fingerprint(), **preprocessing.fields()}}


def module_config(module) -> dict | None:
    """A module's config as JSON-able data, when it carries one (a transformers config or a dataclass)."""
    cfg = getattr(module, "config", None)
    if cfg is None:
        return None
    if hasattr(cfg, "to_dict"):
        return hf_config_dict(cfg)
    if dataclasses.is_dataclass(cfg):
        return json.loads(json.dumps(dataclasses.asdict(cfg), sort_keys=True, default=str))
    return None


def hf_config_dict(hf_config) -> dict:
    """A transformers config as JSON-able data, without the keys that change with the library, not the model."""
    data = json.loads(json.dumps(hf_config.to_dict(), sort_keys=True, default=str))
    for key in _VOLATILE_CONFIG_KEYS:
        data.pop(key, None)
    return data


def identity_changes(old: dict, new: dict) -> list[str]:
    """What differs between two identities, one line per change ([] when the model is the same)."""
    changes = []
    if old.get("class") != new.get("class"):
        changes.append(f"class: {old.get('class')} -> {new.get('class')}")
    changes += dict_changes("config", old.get("config"), new.get("config"))
    if old.get("weights_sha256") != new.get("weights_sha256"):
        changes.append(f"weights: sha256 {str(old.get('weights_sha256'))[:12]}... -> "
                       f"{str(new.get('weights_sha256'))[:12]}...")
    old_pre, new_pre = old.get("preprocessing") or {}, new.get("preprocessing") or {}
    if old_pre.get("fingerprint") != new_pre.get("fingerprint"):
        fields = {k: v for k, v in old_pre.items() if k != "fingerprint"}
        new_fields = {k: v for k, v in new_pre.items() if k != "fingerprint"}
        changes += dict_changes("preprocessing", fields, new_fields) or [
            f"preprocessing: fingerprint {old_pre.get('fingerprint')} -> {new_pre.get('fingerprint')}"]
    return changes


def describe_changes(old: dict, new: dict) -> str:
    """The changes as one sentence for a refusal ('' when none)."""
    changes = identity_changes(old, new)
    if not changes:
        return ""
    more = f"; and {len(changes) - _SHOWN} more" if len(changes) > _SHOWN else ""
    return (f"the model differs from the one the run started with ({old.get('spec')!r} -> {new.get('spec')!r}): "
            f"{'; '.join(changes[:_SHOWN])}{more}")


def dict_changes(prefix: str, old, new) -> list[str]:
    """Each leaf that differs between two (nested) dicts, as 'prefix.key: old -> new' (values clipped)."""
    if old == new:
        return []
    if not (isinstance(old, dict) and isinstance(new, dict)):
        return [f"{prefix}: {fmt_repr(old)} -> {fmt_repr(new)}"]
    changes = []
    for key in sorted(set(old) | set(new), key=str):
        if key not in new:
            changes.append(f"{prefix}.{key}: removed (was {fmt_repr(old[key])})")
        elif key not in old:
            changes.append(f"{prefix}.{key}: added ({fmt_repr(new[key])})")
        elif isinstance(old[key], dict) and isinstance(new[key], dict):
            changes += dict_changes(f"{prefix}.{key}", old[key], new[key])
        elif old[key] != new[key]:
            changes.append(f"{prefix}.{key}: {fmt_repr(old[key])} -> {fmt_repr(new[key])}")
    return changes
