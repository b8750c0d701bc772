"""ipywidgets panels over nblib's pure functions; the only nblib module that imports ipywidgets.

Each panel calls the same function a checked notebook cell calls, and redraws on change. Panels
carry CSS classes for tests and styling: `nblib-budget-panel` / `nblib-shuffle-panel` on the
panel, `nblib-knob-<key>` on each control (key: the function's argument it sets).
"""
from __future__ import annotations

import ipywidgets as W  # noqa: N812
from IPython.display import display
from IPython.utils.capture import capture_output

from nblib import encode  # noqa: F401  hands the encode job to the trace layer; train's: training_panel
from nblib.units import fmt_bytes, fmt_duration, fmt_duration_range


class Panel(W.VBox):
    """A panel: its plain-text form (what a static copy of the notebook shows) is one line, not the
    repr of every child and of the output area's printed text.
    """

    def __repr__(self) -> str:
        return f"<{' '.join(c for c in self._dom_classes if c.startswith('nblib-'))}: interactive in Jupyter or Colab>"

    @property
    def text(self) -> str:
        """What the panel's output area prints now (its text, without the figures)."""
        return "".join(o.get("text", "") for o in self.children[-1].outputs if o.get("output_type") == "stream")


def _output_panel(controls: list, render, css_class: str) -> Panel:
    """A Panel of controls over an Output area; `render(**values)` reruns on every change."""
    out = W.Output()

    def update(_change=None):
        show(out, render, **{c.description_key: c.value for c in controls})

    for control in controls:
        control.observe(update, names="value")
    update()
    panel = Panel([W.HBox(controls[i:i + 3]) for i in range(0, len(controls), 3)] + [out])
    panel.add_class(css_class)
    return panel


def show(out: W.Output, render, *args, **kwargs) -> None:
    """Run `render` and set what it displayed, then printed, as `out`'s outputs in one state update.

    Never `with out:`: that capture gives the Output widget a msg_id, and a headless executor (nbclient,
    under nbconvert and papermill) then mirrors each captured message back to the kernel on the shell
    channel while it awaits the cell's reply there; that reply can go unseen until the cell timeout
    (nbclient issue #312: 60 s or 900 s with the kernel idle). A state update sends nothing back.
    """
    with capture_output() as captured:
        render(*args, **kwargs)
    shown = [{"output_type": "display_data", "data": o.data, "metadata": o.metadata} for o in captured.outputs]
    streams = [("stdout", captured.stdout), ("stderr", captured.stderr)]
    out.outputs = (*shown, *({"output_type": "stream", "name": n, "text": t} for n, t in streams if t))


def _keyed(control, key: str):
    """Tag a control with the argument it sets: `description_key` and the CSS class nblib-knob-<key>."""
    control.description_key = key
    control.add_class(f"nblib-knob-{key}")
    return control


def _slider(key: str, label: str, value: int, lo: int, hi: int, step: int = 1):
    s = W.IntSlider(value=value, min=lo, max=hi, step=step, description=label, continuous_update=False,
                    style={"description_width": "initial"})
    return _keyed(s, key)


def _dropdown(key: str, label: str, options, value):
    d = W.Dropdown(options=options, value=value, description=label,
                   style={"description_width": "initial"})
    return _keyed(d, key)


# ============================================================ 01 memory budgeting


def budget_panel(config, device: str = "t4", drive_quota_gb: float = 15.0, codec_sizes=None) -> Panel:
    """Sliders and dropdowns over budget.predict_budget; the bar chart, the run time and the verdict
    redraw live. The verdict names only knobs the panel has (`memory_budgeting.panel_verdict`);
    `codec_sizes` (measured on the user's texts) sizes the cache of every codec instead of the borrowed ratios.
    """
    from nblib import budget, plots
    from nblib.config import CODECS, OUTPUT_CHOICES, OUTPUT_NAMES
    from nblib.errors import ConfigError
    from nblib.lab.memory_budgeting import panel_verdict, time_readout

    r, m = config.run, config.model
    output_options = [(", ".join(o), o) for o in OUTPUT_CHOICES]
    controls = [
        _slider("batch_size", "batch size", r.batch_size, 1, max(1024, r.batch_size)),
        _slider("consolidate_every", "consolidate every", r.consolidate_every, 1, 200),
        _slider("checkpoint_every", "checkpoint every", r.checkpoint_every, 1, 1000),
        _slider("workers", "workers", r.workers, 0, 8),
        _slider("H_cycles", "H cycles", m.H_cycles, 1, 8),
        _slider("L_cycles", "L cycles", m.L_cycles, 1, 8),
        _slider("n_samples", "n samples", r.n_samples, 1, max(2_000_000, r.n_samples), step=1),
        _dropdown("out_dtype", "output dtype", ["float16", "float32"], r.out_dtype),
        _dropdown("outputs", "outputs kept", output_options,
                  r.outputs if r.outputs in OUTPUT_CHOICES else OUTPUT_NAMES),
        _dropdown("codec", "cache codec", list(CODECS), r.codec),
        _slider("drive_quota_gb", "Drive GB", int(drive_quota_gb), 1, max(2000, int(drive_quota_gb))),
        _dropdown("device", "device", list(budget.DEVICES), device),
    ]

    def render(device, drive_quota_gb, **knobs):
        try:
            b = budget.predict_budget(config.replace(**knobs), device, drive_quota_gb=drive_quota_gb,
                                      codec_sizes=codec_sizes)
        except ConfigError as exc:
            print(f"not a valid config: {exc}")
            return
        fig = plots.budget_bars(b)
        display(fig)
        plots.close(fig)
        print(time_readout(b))   # H/L cycles move the time, not the memory
        print(panel_verdict(b))  # one line: what fits, or every resource over its limit with the knobs that fit

    return _output_panel(controls, render, "nblib-budget-panel")


# ============================================================ 04 shuffle checkpoints

def shuffle_checkpoint_panel(fit, buffer_size: int = 250_000, sample_kb: int = 500, episode_len: int = 100) -> Panel:
    """Buffer size, sample kB and episode length -> checkpoint sizes (tf.data vs resumable) and quality."""
    from nblib.lab import shuffle_checkpoints as lab

    buffer = _keyed(W.FloatLogSlider(value=buffer_size, base=10, min=1, max=6, step=0.25, description="buffer",
                                     continuous_update=False, readout_format=",.0f"), "buffer_size")
    controls = [buffer, _slider("sample_kb", "sample kB", sample_kb, 1, 2000, 1),
                _slider("episode_len", "episode length", episode_len, 1, 10_000, 1)]

    def render(buffer_size, sample_kb, episode_len):
        numbers = lab.checkpoint_and_quality(int(buffer_size), sample_kb, episode_len, fit)
        print(lab.describe_setting(numbers))

    return _output_panel(controls, render, "nblib-shuffle-panel")


# ============================================================ 05 input pipeline

def pipeline_sweep_panel(table) -> Panel:
    """Pick one knob and one of its measured values: that row (median and range of its runs), starred
    on the knob curves. Only configs the sweep measured can be picked (one knob varied from the base).
    """
    from nblib import plots
    from nblib.pipeline.sweep import knob_text

    knob = _dropdown("knob", "knob", list(table.knobs), table.knobs[0])
    value = _dropdown("value", "value", [], None)
    out = W.Output()

    def draw():
        row = next((r for r in table.curve(knob.value) if r[knob.value] == value.value), None)
        if row is None:
            return
        fig = plots.pipeline_knob_curves(table, highlight=row)
        display(fig)
        plots.close(fig)
        runs = table.spread(row)
        print(f"{knob.value}={knob_text(row[knob.value])} (other knobs at the base): "
              f"{runs.text(unit='samples/s')}, data-wait {row['data_wait']:.0%}, startup "
              f"{fmt_duration(row['startup_s'])}, peak RSS {fmt_bytes(row['peak_rss_bytes'])}")

    switching = [False]

    def new_value(_change=None):
        if not switching[0]:
            show(out, draw)

    def new_knob(_change=None):
        switching[0] = True       # the value's options: only those measured with the other knobs at base
        value.options = [(knob_text(r[knob.value]), r[knob.value]) for r in table.curve(knob.value)]
        value.value = table.base[knob.value]
        switching[0] = False
        show(out, draw)

    knob.observe(new_knob, names="value")
    value.observe(new_value, names="value")
    new_knob()
    panel = Panel([W.HBox([knob, value]), out])
    panel.add_class("nblib-pipeline-panel")
    return panel


# ============================================================ 06 training


def training_panel(model, state_bytes: int, best_bytes: int, steps: int = 10_000, provider: str = "s3",
                   ceiling: float | None = None, precision: str = "fp16") -> W.VBox:
    """Batch, accumulation, save and backup intervals and retention; the T4's VRAM and time, Drive and the bucket.

    model: the TRM's ModelConfig. The VRAM at every micro-batch of the slider is `model_vram(train=True)`, the one
    answer (a trace of the loop's own step), all made before the panel shows by one `model_vram_table`; the time
    is `t4_training_time` (a projection, a range) with `ceiling` (the simulated roofline's samples/s) beside it.
    The Drive and bucket bytes follow the one retention rule (`nblib.budget.training.retained_bytes`).
    """
    import nblib.train  # noqa: F401  hands the training job to the trace layer
    from nblib.budget.model_vram import model_vram_table
    from nblib.budget.training import retained_bytes, retained_versions, t4_training_time
    from nblib.train.ops import bucket_cost

    controls = [
        _slider("micro_batch", "micro-batch", 64, 8, 512, 8),
        _slider("accumulation", "accumulation", 1, 1, 16),
        _slider("save_every", "save every (steps)", 50, 5, 1000, 5),
        _slider("backup_every", "backup every (steps)", 200, 5, 5000, 5),
        _slider("keep_last", "keep last N", 3, 1, 10),
    ]
    batch = controls[0]
    traced = {v.batch_size: v for v in model_vram_table(model, range(batch.min, batch.max + 1, batch.step), "t4",
                                                        precision=precision, train=True)}

    def render(micro_batch, accumulation, save_every, backup_every, keep_last):
        vram = traced[micro_batch]
        backup = max(1, backup_every // save_every) * save_every   # the multiple of save_every TrainConfig offers
        samples = steps * micro_batch * accumulation
        time = t4_training_time(model, samples, precision)
        states, bests = retained_versions(keep_last)
        drive = retained_bytes(state_bytes, best_bytes, keep_last)
        cost = bucket_cost(state_bytes, best_bytes, steps=steps, backup_every=backup, keep_last=keep_last,
                           provider=provider)
        print(f"effective batch {micro_batch * accumulation:,} ({accumulation} x {micro_batch})")
        print(f"T4 VRAM at micro-batch {micro_batch} (traced: model_vram, {precision}, CUDA context included): "
              f"{vram.headline()}; largest micro-batch that fits: {vram.largest_batch:,}")
        print(f"T4 time, {steps:,} steps ({samples:,} samples): {time.hours_text()} at {time.rate_text()} "
              f"({time.label})" + (f"; ceiling {ceiling:,.0f} samples/s (simulated roofline): at least "
                                   f"{fmt_duration(samples / ceiling)}" if ceiling else ""))
        print(f"Drive (last {states} states + {bests} best):   {fmt_bytes(drive)} of the 15 GB free quota")
        local = retained_bytes(state_bytes, best_bytes, keep_last, saving=True)
        print(f"local disk (retention + a save):    {fmt_bytes(local)}")
        print(f"bucket: {cost.line()}")
        rate, n = time.samples_per_s, backup * micro_batch * accumulation      # the samples a lost VM costs
        lost = (n / rate.high, n / rate.mid, n / rate.low)
        print(f"backup every {backup} steps" + (f" (a multiple of save every {save_every}, as train takes it)"
                                                if backup != backup_every else "")
              + f": a lost VM costs at most {backup} steps, {fmt_duration_range(*lost)} on a T4 ({time.label})")

    return _output_panel(controls, render, "nblib-training-panel")
