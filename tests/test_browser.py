"""The notebooks' widgets work in a real JupyterLab, driven by a real (headless) Chromium.

One JupyterLab server (smoke profile, temporary outputs and Drive, copies of the notebooks) serves every test.
The copies leave out the measurement cells no widget reads (`LEFT_OUT`: nbval runs every cell of every notebook
in `make test`); each test opens a notebook, runs it with Run > Run All Cells, and fails on any cell error or any
error the page logs. The panel tests move a slider with the keyboard and compare what the panel shows with what the test
process computes from the same pure function; screenshots of the moved panels land in outputs/browser/.

Needs the `playwright` Python package and Debian's `chromium` (nothing is downloaded at run time); without
either the module is skipped.
"""
from __future__ import annotations

import base64
import io
from pathlib import Path

import pytest
from browser_helpers import LabServer, NotebookPage, PageErrors, chromium_path, saved_notebook_errors

sync_api = pytest.importorskip("playwright.sync_api", reason="browser tests need `pip install playwright`")
CHROMIUM = chromium_path()
if CHROMIUM is None:
    pytest.skip("browser tests need Debian's chromium (apt-get install chromium)", allow_module_level=True)

pytestmark = pytest.mark.browser

REPO = Path(__file__).resolve().parents[1]
SCREENSHOTS = REPO / "outputs" / "browser"
NOTEBOOKS = ("01_memory_budgeting.ipynb", "02_cache_population.ipynb", "04_shuffle_buffer_checkpoints.ipynb")
# Code cells left out of the browser's copies, by a call each makes: measurements whose results no widget and
# no later kept cell reads (about 80 of the 120 s the three notebooks take). Each marker must match one cell.
LEFT_OUT = {
    "01_memory_budgeting.ipynb": ("measure_forward_peaks(", "simulated_vram(", "predicted_vs_measured("),
    "02_cache_population.ipynb": ("worker_scaling(", "lab.run_and_kill(", "resumed = subprocess.run(",
                                  "reference_dir = ", "lab.flip_a_byte(", "compare_formats(", "export.layout_bytes("),
    "04_shuffle_buffer_checkpoints.ipynb": ("lab.measure_ops(", "resumable_rows = ",
                                            "vs_buffer(tf_rows + resumable_rows", "lab.resume_proof(",
                                            "compare_shuffles(", "for r in builtins", "builtins_conclusion(",
                                            "lab.quality_vs_buffer(", "shuffle_quality_vs_buffer(",
                                            "lab.buffer_answer("),
}


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A JupyterLab server over copies of the notebooks, smoke profile, outputs and Drive in temporary folders."""
    home = tmp_path_factory.mktemp("lab")
    root = home / "notebooks"
    root.mkdir()
    for name in NOTEBOOKS:
        copy_without(REPO / "notebooks" / name, root / name, LEFT_OUT.get(name, ()))
    server = LabServer(root=root, home=home, env={
        "NBLIB_PROFILE": "smoke", "NBLIB_OUTPUTS": str(home / "outputs"), "NBLIB_DRIVE_DIR": str(home / "drive")})
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, headless=True)
        yield chromium
        chromium.close()


@pytest.fixture
def open_notebook(lab, browser):
    """Open a notebook in a fresh page; at the end, fail on page errors and shut its kernel down."""
    opened = []

    def _open(name: str) -> NotebookPage:
        context = browser.new_context(viewport={"width": 1400, "height": 1000})
        page = context.new_page()
        errors = PageErrors(page)
        opened.append((name, context, errors))
        return NotebookPage(page, lab, name)

    yield _open
    for name, context, errors in opened:
        screenshot(context.pages[0], f"{Path(name).stem}_page.png")   # the whole page as the test left it
        lab.shutdown_kernel(name)
        context.close()
        assert not errors.errors, f"{name}: the page logged errors:\n" + "\n".join(errors.errors)


def run_notebook(nb: NotebookPage) -> None:
    """Run every cell, save, and fail with the traceback of any cell that raised or did not run."""
    nb.run_all()
    problems = saved_notebook_errors(nb.save())
    assert not problems, f"{nb.notebook} in JupyterLab:\n" + "\n".join(problems)


def test_budget_panel_follows_the_batch_size_slider(open_notebook):
    from nblib import budget, plots
    from nblib.codec_sizes import CodecSizes
    from nblib.config import PipelineConfig

    nb = open_notebook("01_memory_budgeting.ipynb")
    run_notebook(nb)
    knobs = nb.server.kernel_value(nb.notebook, "{'config': SEED.to_dict(), 'device': DEVICE, 'quota': DRIVE_QUOTA_GB, "
                                                "'sizes': __import__('dataclasses').asdict(SIZES)}")
    config = PipelineConfig.from_dict(knobs["config"])
    sizes = CodecSizes(**knobs["sizes"])           # the measurement the notebook made: sizes, rates, count

    panel = nb.widget_panel("batch size")
    panel.scroll_into_view_if_needed()
    verdict_before, chart_before = panel_verdict(panel), panel_chart(panel)
    handle = slider_handle(nb, "batch size")
    handle.focus()
    for key in ("End", "ArrowLeft", "PageDown"):     # to the maximum, one step down, one page (5 steps) down
        handle.press(key)
    batch_size = int(float(handle.get_attribute("aria-valuenow")))
    assert batch_size == int(float(handle.get_attribute("aria-valuemax"))) - 6

    expected = budget.predict_budget(config.replace(batch_size=batch_size), knobs["device"],
                                     drive_quota_gb=knobs["quota"], codec_sizes=sizes)   # as the panel
    wait_for_text(panel, expected.verdict, lambda: panel_verdict(panel))
    assert expected.verdict != verdict_before
    chart = panel_chart(panel)
    assert chart != chart_before
    figure = plots.budget_bars(expected)
    try:
        assert same_pixels(chart, figure_png(figure)), "chart != budget_bars(predict_budget(new))"
    finally:
        plots.close(figure)
    screenshot(panel, "01_budget_panel.png")


def test_shuffle_checkpoint_panel_follows_the_buffer_slider(open_notebook):
    from nblib.lab import shuffle_checkpoints as lab

    nb = open_notebook("04_shuffle_buffer_checkpoints.ipynb")
    run_notebook(nb)
    fit = lab.BytesFit(**nb.server.kernel_value(nb.notebook, "__import__('dataclasses').asdict(fit)"))

    panel = nb.widget_panel("buffer")
    panel.scroll_into_view_if_needed()
    text_before = panel_text(panel)
    handle = slider_handle(nb, "buffer")
    handle.focus()
    for key in ("ArrowLeft", "ArrowLeft"):             # two steps of 10**0.25 down the log scale
        handle.press(key)
    buffer_size = int(10 ** float(handle.get_attribute("aria-valuenow")))   # the slider moves the exponent
    sample_kb = int(readout(nb, "sample kB"))
    episode_len = int(readout(nb, "episode length"))

    expected = lab.describe_setting(lab.checkpoint_and_quality(buffer_size, sample_kb, episode_len, fit))
    wait_for_text(panel, expected, lambda: panel_text(panel))
    assert expected != text_before
    assert f"buffer {buffer_size:,} x" in expected and buffer_size < 250_000
    screenshot(panel, "04_shuffle_checkpoint_panel.png")


def test_cache_population_shows_a_widget_progress_bar_that_reaches_100_percent(open_notebook):
    nb = open_notebook("02_cache_population.ipynb")
    run_notebook(nb)
    bars = nb.panel.locator(".jp-Cell-outputArea .widget-hprogress")
    assert bars.count() >= 1, "no tqdm widget bar in any output: use tqdm.auto so Jupyter gets the widget"
    for bar in bars.all():
        row = bar.locator("xpath=..")                  # tqdm's HBox: description | bar | counts and rate
        fill = bar.locator(".progress-bar")
        assert "100%" in row.inner_text(), row.inner_text()
        assert fill.evaluate("e => e.style.width") == "100%"
        assert "progress-bar-danger" not in (fill.get_attribute("class") or ""), "tqdm closed the bar on an error"
    cell = nb.panel.locator(".jp-CodeCell").filter(has=nb.page.locator(".widget-hprogress")).first
    screenshot(cell, "02_populate_progress.png")


def copy_without(source: Path, target: Path, markers: tuple[str, ...]) -> None:
    """Copy a notebook without the code cells that contain one of `markers` (each must match exactly one)."""
    import nbformat

    notebook = nbformat.read(source, as_version=4)
    for marker in markers:
        hits = [c for c in notebook.cells if c.cell_type == "code" and marker in c.source]
        assert len(hits) == 1, f"{source.name}: {marker!r} matches {len(hits)} code cells, not 1 (update LEFT_OUT)"
    notebook.cells = [c for c in notebook.cells
                      if not (c.cell_type == "code" and any(m in c.source for m in markers))]
    nbformat.write(notebook, target)


# ----------------------------------------------------------------------------------------- page reading


def slider_handle(nb: NotebookPage, label: str):
    """The keyboard-focusable handle (role=slider) of the slider described `label`."""
    return nb.control(label).get_by_role("slider")


def readout(nb: NotebookPage, label: str) -> str:
    return nb.control(label).locator(".widget-readout").inner_text().replace(",", "").strip()


def panel_text(panel) -> str:
    """Everything the panel's output area printed."""
    return "\n".join(t.strip("\n") for t in panel.locator(".widget-output .jp-RenderedText").all_inner_texts())


def panel_verdict(panel) -> str:
    """The last printed line of the panel's output: the verdict."""
    text = panel_text(panel).strip()  # read once: the kernel may clear and redraw the output in between
    return text.splitlines()[-1] if text else ""


def panel_chart(panel) -> bytes:
    """The PNG the panel's output area shows."""
    src = panel.locator(".widget-output img").get_attribute("src")
    assert src.startswith("data:image/png;base64,"), src[:60]
    return base64.b64decode(src.split(",", 1)[1])


def wait_for_text(panel, expected: str, read, timeout: float = 60.0) -> None:
    """Wait until `read()` gives `expected` (the kernel redraws after each key); fail showing both."""
    import time

    deadline = time.monotonic() + timeout
    seen = read()
    while seen != expected and time.monotonic() < deadline:
        time.sleep(0.25)
        seen = read()
    assert seen == expected, f"the panel shows:\n{seen}\nexpected:\n{expected}"


def figure_png(figure) -> bytes:
    """The PNG a Jupyter kernel displays for `figure` (IPython's print_figure, inline backend defaults)."""
    from IPython.core.pylabtools import print_figure

    return print_figure(figure, "png", bbox_inches="tight")


def same_pixels(png_a: bytes, png_b: bytes) -> bool:
    from PIL import Image

    a, b = (Image.open(io.BytesIO(p)).convert("RGBA") for p in (png_a, png_b))
    return a.size == b.size and a.tobytes() == b.tobytes()


def screenshot(locator, name: str) -> Path:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / name
    locator.screenshot(path=str(path))
    return path
