"""Notebook 04's lab split (issue 21): its maths without TensorFlow, its narrow door to tfdata, no leftover folders."""
from __future__ import annotations

import ast
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import subprocess_env
from nblib import tfdata, verdict
from nblib.lab import shuffle_checkpoints as lab
from nblib.lab.shuffle_checkpoints import experiments
from nblib.lab.shuffle_checkpoints.maths import REFERENCE_SAMPLE_BYTES

LAB = Path(lab.__file__).parent


def _row(buffer_size, symbolic, bytes_on_disk, *, sample_bytes=1000, peak=None, rotating=None, pipeline=None):
    return tfdata.CheckpointRow(pipeline or tfdata.TF_SHUFFLE, buffer_size, symbolic, sample_bytes, bytes_on_disk,
                                0.1, 0.1, peak or bytes_on_disk, rotating or 2 * bytes_on_disk, 0,
                                buffer_size * sample_bytes // 10, buffer_size * sample_bytes // 5, True)


# ------------------------------------------------------------------ the maths, without TensorFlow


def test_the_lab_and_its_maths_import_without_tensorflow():
    code = ("import sys; from nblib.lab import shuffle_checkpoints as lab; "
            "lab.fit_bytes_per_element; print('tensorflow' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=subprocess_env(),
                         check=True)
    assert out.stdout.strip() == "False"


def test_the_fit_recovers_a_known_line_and_extrapolates_it():
    # bytes = 700 + buffer x 1,030 (30 B of framing per 1,000 B sample), exactly.
    rows = [_row(b, True, 700 + 1030 * b) for b in (100, 500, 2000)] + [_row(100, False, 5)]
    fit = lab.fit_bytes_per_element(rows, symbolic=True)
    assert fit.bytes_per_element == pytest.approx(1030) and fit.fixed_bytes == pytest.approx(700, abs=1e-6)
    assert fit.overhead_per_element == pytest.approx(30)
    assert fit.predict(250_000, 500_000) == pytest.approx(700 + 250_000 * 500_030)
    reference_row = next(e for e in lab.extrapolate(fit, rows) if e.buffer_size == 250_000)
    assert reference_row.reference_bytes == 250_000 * REFERENCE_SAMPLE_BYTES
    assert reference_row.predicted_rotating_peak == pytest.approx(2 * reference_row.predicted_bytes, rel=1e-6)


def test_the_reference_row_has_one_size_in_the_table_and_in_the_widget():
    rows = [_row(b, True, 700 + 1030 * b) for b in (100, 500, 2000)]
    fit = lab.fit_bytes_per_element(rows, symbolic=True)
    table_row = next(e for e in lab.extrapolate(fit, rows) if e.buffer_size == 250_000)
    widget = lab.checkpoint_and_quality(250_000, REFERENCE_SAMPLE_BYTES / 1e3, 100, fit)
    assert widget["sample_bytes"] == table_row.sample_bytes == REFERENCE_SAMPLE_BYTES
    assert widget["tf_checkpoint_bytes"] == table_row.predicted_bytes
    assert widget["tf_rotating_peak_bytes"] == table_row.predicted_rotating_peak
    assert widget["tf_buffer_ram_bytes"] == table_row.buffer_ram_bytes


def test_the_ram_note_sets_the_buffer_against_the_t4_presets_ram():
    from nblib import budget
    rows = [_row(b, True, 700 + 1030 * b) for b in (100, 500, 2000)]
    ram = budget.device_preset("t4").ram_bytes
    note = lab.ram_note(rows)
    assert f"{250_000 * REFERENCE_SAMPLE_BYTES / ram:.1f}x the {ram / 1e9:.1f} GB" in note


def test_measured_factors_take_the_worst_row_of_the_largest_buffer():
    rows = [_row(100, True, 1000, peak=1000, rotating=2000), _row(400, True, 4000, peak=4400, rotating=8000),
            _row(400, False, 5000, peak=5000, rotating=11_500)]
    f = lab.measured_factors(rows)
    assert f["temp_factor"] == pytest.approx(1.1) and f["rotating_factor"] == pytest.approx(2.3)
    checks = lab.disk_model_checks(rows)
    assert [c.verdict for c in checks] == ["right", "wrong"]  # 1.1x vs the model's 1x; 2.3x vs 2x (> 2.2x)
    assert lab.symbolic_saving(rows) == {400: pytest.approx(1 - 4000 / 5000)}


def test_both_notebooks_use_the_one_definition_of_right_within_10_percent():
    from nblib.lab.memory_budgeting import ReferenceCheck

    for value, expected in ((1.09, 1.0), (1.11, 1.0), (0.91, 1.0), (0.89, 1.0)):
        ours = ReferenceCheck("x", value, expected, "B", "").right
        theirs = lab.Check("x", "budget model", expected, value, "B").right
        assert ours == theirs == verdict.within_tolerance(value, expected)
    assert verdict.within_tolerance(2.1, (1.5, 2.0)) and not verdict.within_tolerance(1.3, (1.5, 2.0))


def test_the_quality_rules_are_consistent():
    k = 100
    b = lab.buffer_needed(k, 0.01)
    assert lab.predicted_same_episode_share(b, k) <= 0.01 < lab.predicted_same_episode_share(b - 10, k)


# ------------------------------------------------------------------ a narrow door to tfdata


def test_the_lab_imports_only_tfdatas_public_names():
    imported = set()
    for path in LAB.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "nblib.tfdata":
                imported |= {alias.name for alias in node.names}
            assert not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                        and node.value.id == "tfdata"), f"{path.name} reaches into tfdata.{node.attr}"
    assert imported <= set(tfdata.__all__), imported - set(tfdata.__all__)
    assert not {"global_shuffle_op", "tensorflow", "same_element", "folder_bytes"} & imported
    assert not any(name.startswith("_") for name in imported)
    assert len(imported) <= 16, sorted(imported)


# ------------------------------------------------------------------ no leftover folders on an exception


@pytest.fixture
def temp_root(tmp_path, monkeypatch):
    """Make tempfile.mkdtemp create folders under tmp_path, so leftovers can be counted."""
    root = tmp_path / "tmp"
    root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    return root


def _leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def _write_then_fail(where: Path, error=RuntimeError):
    Path(where).mkdir(parents=True, exist_ok=True)
    (Path(where) / "ckpt.data").write_bytes(b"x" * 1000)
    raise error("disk full (forced by the test)")


def test_measure_checkpoint_leaves_no_folder_on_an_exception(temp_root, monkeypatch):
    monkeypatch.setattr(experiments, "measure_iterator_checkpoint",
                        lambda label, spec, build, where, steps: _write_then_fail(where))
    with pytest.raises(RuntimeError, match="forced"):
        lab.measure_checkpoint([10, 20], 1, symbolic=(True,))
    assert _leftovers(temp_root) == []


def test_measure_ops_leaves_no_folder_on_an_interrupt(temp_root, monkeypatch):
    monkeypatch.setattr(experiments, "one_op_pipelines", lambda spec: {"range": lambda: None})
    monkeypatch.setattr(experiments, "iterator_checkpoint_bytes",
                        lambda dataset, consumed, where: _write_then_fail(where, KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        lab.measure_ops(1, n=16)
    assert _leftovers(temp_root) == []


def test_measure_state_checkpoint_leaves_no_folder_or_file_on_an_exception(temp_root, monkeypatch, tmp_path):
    from nblib import shuffle

    def fail(path, into, **kwargs):
        raise OSError("read error (forced by the test)")

    monkeypatch.setattr(shuffle, "load_state", fail)
    with pytest.raises(OSError, match="forced"):
        lab.measure_state_checkpoint([10])
    assert _leftovers(temp_root) == []
    given = tmp_path / "given"
    with pytest.raises(OSError, match="forced"):
        lab.measure_state_checkpoint([10], folder=given)
    assert list(given.iterdir()) == []      # the caller's folder is kept, the state file is not


def test_compare_shuffles_removes_its_folder_on_an_exception(tmp_path, monkeypatch):
    folder = tmp_path / "builtins"
    monkeypatch.setattr(experiments, "method_unavailable", lambda method: "")
    monkeypatch.setattr(experiments, "shuffle_pipeline", lambda spec, method: _write_then_fail(folder / "x"))
    with pytest.raises(RuntimeError, match="forced"):
        lab.compare_shuffles(tfdata.PipelineSpec(n_samples=40, sample_kb=1, buffer_size=10), folder)
    assert not folder.exists()


def test_a_checkpoint_round_trip_removes_its_folder_when_the_restore_fails(tmp_path):
    pytest.importorskip("tensorflow")
    tf = tfdata.tensorflow()
    builds = []

    def build():
        builds.append(1)
        if len(builds) == 2:       # the fresh pipeline for the restore
            raise RuntimeError("the restore failed (forced by the test)")
        return tf.data.Dataset.range(100).map(lambda i: {"index": i})

    with pytest.raises(RuntimeError, match="forced"):
        tfdata.checkpoint_round_trip(build, tmp_path / "proof", 5, 10)
    assert not (tmp_path / "proof").exists()
    trip = tfdata.checkpoint_round_trip(lambda: tf.data.Dataset.range(100).map(lambda i: {"index": i}),
                                        tmp_path / "proof", 5, 10, strict=True)
    assert trip.identical and len(trip.restored) == 10 and trip.checkpoint_bytes > 0
    assert int(trip.restored[0]["index"]) == 5 and not (tmp_path / "proof").exists()


def test_measure_iterator_checkpoint_removes_its_folder_when_the_pipeline_fails(tmp_path):
    pytest.importorskip("tensorflow")

    def build():
        raise RuntimeError("the pipeline failed (forced by the test)")

    with pytest.raises(RuntimeError, match="forced"):
        tfdata.measure_iterator_checkpoint("x", tfdata.PipelineSpec(), build, tmp_path / "m", 3)
    assert not (tmp_path / "m").exists()
