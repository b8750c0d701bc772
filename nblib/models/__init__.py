"""The model contract: any torch module for encode, train, budget and simulate; the TRM is the default.

`load_model(spec, weights)` builds a module from a spec string (one per source in `SOURCES`: trm, hf:,
timm:, package.module:factory) with seeded random weights and loads a weights file strictly;
its `preprocessing` turns the cache's uint8 NHWC images into the model's input; `named_outputs`
turns a tensor, a dict or a transformers ModelOutput into named tensors; `model_identity` and
`identity_changes` let a resume refuse another model, naming what changed.
"""
from __future__ import annotations

from nblib.models.identity import (
    describe_changes,
    identity_changes,
    model_identity,
)
from nblib.models.load import (
    SOURCES,
    LoadedModel,
    ModelSource,
    load_model,
    names_trm,
    parse_spec,
    spec_forms,
)
from nblib.models.outputs import named_outputs
from nblib.models.preprocessing import (
    Preprocessing,
    preprocessing_from,
    preprocessing_from_timm,
)
from nblib.models.weights import (
    check_state_dict,
    load_weights,
    save_weights,
    weights_sha256,
)

__all__ = [
    "SOURCES", "LoadedModel", "ModelSource", "spec_forms", "Preprocessing", "check_state_dict", "describe_changes",
    "identity_changes", "load_model", "load_weights", "model_identity", "named_outputs", "names_trm", "parse_spec",
    "preprocessing_from", "preprocessing_from_timm", "save_weights", "weights_sha256",
]
