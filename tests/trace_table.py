"""The shipped table of TRM encode traces (nblib/trace_seed): its specs, traced now, and the writer.

`tests/test_encode_trace.py` compares every shipped file with a fresh trace of its spec to the byte; after a
change to the TRM, the encode loop, the offload or the trace, write the table again with
`.venv/bin/python tests/trace_table.py`.
"""
from __future__ import annotations

import json
from pathlib import Path

from nblib.budget import trace_store
from nblib.budget._checks import attention_on
from nblib.budget.devices import device_preset
from nblib.budget.encode_trace import TABLE, encode_spec, entry_text, traced_entries
from nblib.config import OUTPUT_CHOICES, OUTPUT_DTYPES, preset

# (config, device) of every budget the notebooks, panels and plans make: on a T4 the widget's outputs and dtypes
# over the presets; on the other GPUs seed_t4 as it is (01's largest batch per device; h200 shares h100's sm_90)
TABLE_CONFIGS = (*((preset(name).replace(outputs=outputs, out_dtype=dtype), "t4") for name in ("seed_t4", "t4", "smoke")
                   for outputs in OUTPUT_CHOICES for dtype in OUTPUT_DTYPES),
                 *((preset("seed_t4"), gpu) for gpu in ("l4", "a100-40gb", "h100")))


def entry_path(spec: dict) -> Path:
    """The shipped table's file for `spec` under this torch and environment (trace_store.entry_key)."""
    return TABLE / trace_store.entry_name(trace_store.entry_key(spec, trace_store.torch_release()))


def write_table() -> list[Path]:
    """Trace every (config, device) of TABLE_CONFIGS and write its entry."""
    TABLE.mkdir(exist_ok=True)
    paths = []
    for entry in table_entries():
        paths.append(entry_path(entry["spec"]))
        paths[-1].write_text(entry_text(entry), encoding="utf-8")
    return paths


def table_entries() -> list[dict]:
    """The table's entries, traced now: one child process per model."""
    specs = table_specs()
    models = {json.dumps(model_payload_of(s), sort_keys=True): [] for s in specs}
    for spec in specs:
        models[json.dumps(model_payload_of(spec), sort_keys=True)].append(spec)
    return [entry for group in models.values() for entry in traced_entries(group)]


def model_payload_of(spec: dict) -> dict:
    """What a child builds once for several specs: the model."""
    return {k: spec[k] for k in ("spec", "weights", "trm_model")}


def table_specs() -> list[dict]:
    """The distinct specs of TABLE_CONFIGS, each with the attention its device runs (seed_t4 and t4 share a model)."""
    specs = [encode_spec(c, dev := device_preset(d), "fp16", attention_on(dev, None), "async")
             for c, d in TABLE_CONFIGS]
    return [s for i, s in enumerate(specs) if s not in specs[:i]]


if __name__ == "__main__":
    import nblib.encode  # noqa: F401  hands the encode job to the trace layer

    for path in write_table():
        print(path)
