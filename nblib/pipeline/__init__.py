"""Input-pipeline throughput: measure where a step's time goes, sweep the knobs, recommend a config.

Parts: `harness` (`measure_pipeline`: samples/s, data-wait, startup, peak RSS of any iterable of
batches), `sweep` (one tidy row per config of a knob grid; Ctrl-C keeps the rows measured),
`recommend` (fastest config under a RAM cap, and the knob that mattered). The pipelines swept
are built in `tf_pipelines` (tf.data) and `torch_loaders` (DataLoader over the sharded cache),
imported on use so `import nblib.pipeline` loads neither TensorFlow nor torch; `grids` holds the
suite's knob grids and sweeps (notebook 05 and `python -m nblib pipeline`). Notebook 05's
experiments and verdicts live in `nblib.lab.input_pipeline`.
"""
from __future__ import annotations

from nblib.pipeline.harness import (
    ComputeStandIn,
    EmptyPipelineError,
    PipelineReport,
    batch_size_of,
    measure_pipeline,
)
from nblib.pipeline.recommend import Recommendation, recommend
from nblib.pipeline.sweep import SweepTable, knob_names, knob_text, plan_configs, sweep

__all__ = [
    "ComputeStandIn", "EmptyPipelineError", "PipelineReport", "Recommendation", "SweepTable",
    "batch_size_of", "knob_names", "knob_text", "measure_pipeline", "plan_configs", "recommend",
    "sweep",
]
