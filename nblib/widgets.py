"""ipywidgets panels over nblib's pure functions; the only nblib module that imports ipywidgets.

Each panel calls the same function a checked notebook cell calls, and redraws on change.
"""
from __future__ import annotations

import ipywidgets as W  # noqa: N812
from IPython.display import clear_output, display


def _output_panel(controls: list, render) -> W.VBox:
    """A VBox of controls over an Output area; `render(**values)` reruns on every change."""
    out = W.Output()

    def update(_change=None):
        with out:
            clear_output(wait=True)
            render(**{c.description_key: c.value for c in controls})

    for control in controls:
        control.observe(update, names="value")
    update()
    return W.VBox([W.HBox(controls[i:i + 3]) for i in range(0, len(controls), 3)] + [out])


def _slider(key: str, label: str, value: int, lo: int, hi: int, step: int = 1):
    s = W.IntSlider(value=value, min=lo, max=hi, step=step, description=label, continuous_update=False,
                    style={"description_width": "initial"})
    s.description_key = key
    return s


def _dropdown(key: str, label: str, options, value):
    d = W.Dropdown(options=options, value=value, description=label,
                   style={"description_width": "initial"})
    d.description_key = key
    return d


# ============================================================ 01 memory budgeting


def budget_panel(config, device: str = "t4", drive_quota_gb: float = 15.0) -> W.VBox:
    """Sliders and dropdowns over budget.predict_budget; the bar chart and verdict redraw live."""
    from nblib import budget, plots
    from nblib.config import OUTPUT_CHOICES, OUTPUT_NAMES
    from nblib.errors import ConfigError

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
        _dropdown("device", "device", list(budget.DEVICES), device),
    ]

    def render(device, **knobs):
        try:
            b = budget.predict_budget(config.replace(**knobs), device, drive_quota_gb=drive_quota_gb)
        except ConfigError as exc:
            print(f"not a valid config: {exc}")
            return
        fig = plots.budget_bars(b)
        display(fig)
        plots.close(fig)
        print(b.verdict)

    return _output_panel(controls, render)

# ============================================================ end 01


# ============================================================ 04 shuffle checkpoints

def shuffle_checkpoint_panel(fit, buffer_size: int = 250_000, sample_kb: int = 500, episode_len: int = 100) -> W.VBox:
    """Buffer size, sample kB and episode length -> checkpoint sizes (tf.data vs resumable) and quality."""
    from nblib.lab import shuffle_checkpoints as lab

    buffer = W.FloatLogSlider(value=buffer_size, base=10, min=1, max=6, step=0.25, description="buffer",
                              continuous_update=False, readout_format=",.0f")
    buffer.description_key = "buffer_size"
    controls = [buffer, _slider("sample_kb", "sample kB", sample_kb, 1, 2000, 1),
                _slider("episode_len", "episode length", episode_len, 1, 10_000, 1)]

    def render(buffer_size, sample_kb, episode_len):
        numbers = lab.checkpoint_and_quality(int(buffer_size), sample_kb, episode_len, fit)
        print(lab.describe_setting(numbers))

    return _output_panel(controls, render)


# ============================================================ end 04
