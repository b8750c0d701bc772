"""Streaming, resumable encoding of an image cache with the TRM vision encoder.

`encode` streams an `ImageSource` through the encoder into durable parts (`run`), moving outputs
off the device per batch or every K batches (`offload`), then `consolidate` merges the parts into
one `.npy` per output plus an index, and `load_outputs` maps them back, checked against it.
Importing this package does not import torch: a run imports it when it starts (the loader and
`HostPart` live in `nblib.encode.offload`, which imports it).
"""
from __future__ import annotations

from nblib.encode import traced  # noqa: F401  (hands the encode job to the trace layer: nblib.budget.traced_jobs)
from nblib.encode.consolidate import (
    INDEX_NAME,
    consolidate,
    hash_outputs,
    load_outputs,
    read_index,
    recorded_hashes,
)
from nblib.encode.layout import (
    PARTS_FOLDER,
    open_store,
    plan_run,
    read_run_manifest,
)
from nblib.encode.protocols import ImageSource, PartStore
from nblib.encode.run import OFFLOAD_MODES, EncodeReport, encode
from nblib.store.parts import VerifyLevel

__all__ = [
    "INDEX_NAME", "OFFLOAD_MODES", "PARTS_FOLDER", "EncodeReport", "ImageSource", "PartStore", "VerifyLevel",
    "consolidate", "encode", "hash_outputs", "load_outputs", "open_store", "plan_run", "read_index",
    "read_run_manifest", "recorded_hashes",
]
