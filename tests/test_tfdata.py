"""nblib.tfdata and notebook 04's lab: real tf.data checkpoints, the budget's disk model, resumable shuffles."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from conftest import subprocess_env
from nblib import budget, shuffle, tfdata
from nblib.disk import disk_usage
from nblib.errors import BudgetExceeded, ConfigError
from nblib.lab import shuffle_checkpoints as lab

SMALL_KB = 16  # 73 x 73 x 3 = 15,987 bytes per sample


def test_import_nblib_tfdata_does_not_import_tensorflow():
    code = "import sys, nblib.tfdata; print('tensorflow' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=subprocess_env(),
                         check=True)
    assert out.stdout.strip() == "False"


def test_image_shape_matches_decimal_kb():
    assert tfdata.image_shape(150) == (224, 224, 3)
    assert abs(tfdata.PipelineSpec(sample_kb=500).sample_bytes - 500_000) < 1_000


@pytest.mark.parametrize("field, value", [("n_samples", 0), ("buffer_size", -1), ("sample_kb", 0),
                                          ("content", "zeros"), ("sources", 0)])
def test_pipeline_spec_refuses_bad_knobs_naming_the_field(field, value):
    with pytest.raises(ConfigError, match=field):
        tfdata.PipelineSpec(**{field: value})


@pytest.mark.slow
def test_tf_shuffle_checkpoint_holds_the_whole_buffer_even_when_symbolic(tmp_path):
    rows = lab.measure_checkpoint([50, 200], SMALL_KB, symbolic=(False, True), folder=tmp_path)
    assert len(rows) == 4
    for row in rows:
        assert row.exact_resume, row
        assert not row.error
        assert row.bytes_on_disk >= row.buffer_size * row.sample_bytes  # every buffered sample is written
        assert row.peak_disk_rotating_bytes >= 1.9 * row.bytes_on_disk  # old + new while the previous is kept
    fit = lab.fit_bytes_per_element(rows, symbolic=True)
    assert fit.sample_bytes <= fit.bytes_per_element < 1.05 * fit.sample_bytes
    predicted = fit.predict(250_000, lab.REFERENCE_SAMPLE_BYTES)
    assert 124e9 < predicted < 127e9  # the reference's 125 GB, recovered from small measurements
    assert disk_usage(tmp_path) == 0  # measured checkpoints are deleted once measured


@pytest.mark.slow
def test_constant_images_compress_and_would_hide_the_problem(tmp_path):
    random, = lab.measure_checkpoint([200], SMALL_KB, symbolic=(True,), folder=tmp_path)
    constant, = lab.measure_checkpoint([200], SMALL_KB, symbolic=(True,), folder=tmp_path, content="constant")
    assert constant.bytes_on_disk * 5 < random.bytes_on_disk


@pytest.mark.slow
def test_interleaved_pipeline_resumes_exactly(tmp_path):
    rows = lab.measure_checkpoint([64], SMALL_KB, symbolic=(False, True), folder=tmp_path, sources=3)
    assert all(r.exact_resume and not r.error for r in rows)


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["buffer", "global"])
def test_resumable_pipeline_checkpoint_roundtrip_gives_the_next_elements_and_stays_small(tmp_path, algorithm):
    tf = tfdata.tensorflow()
    spec = tfdata.PipelineSpec(n_samples=700, sample_kb=SMALL_KB, buffer_size=500, seed=3, batch_size=4,
                               prefetch=2)
    iterator = iter(tfdata.resumable_shuffle_pipeline(spec, algorithm))
    for _ in range(9):
        next(iterator)
    path = tf.train.Checkpoint(iterator=iterator).write(str(tmp_path / "ckpt"))
    expected = [next(iterator) for _ in range(20)]
    fresh = iter(tfdata.resumable_shuffle_pipeline(spec, algorithm))
    tf.train.Checkpoint(iterator=fresh).read(path).assert_consumed()
    got = [next(fresh) for _ in range(20)]
    for e, g in zip(expected, got):
        np.testing.assert_array_equal(e["index"].numpy(), g["index"].numpy())
        np.testing.assert_array_equal(e["image"].numpy(), g["image"].numpy())
    size = disk_usage(tmp_path)
    assert size < 4096, (f"checkpoint of the resumable pipeline is {size} B; a tf.data buffer would be "
                         f"{500 * spec.sample_bytes:,} B")


@pytest.mark.slow
def test_measured_rows_of_the_resumable_pipeline_are_exact_and_tiny(tmp_path):
    rows = lab.measure_checkpoint([100, 400], SMALL_KB, resumable="buffer", folder=tmp_path)
    assert all(r.exact_resume and r.bytes_on_disk < 4096 and r.symbolic for r in rows)


@pytest.mark.slow
@pytest.mark.parametrize("n", [1, 2, 3, 7, 1000, 4097])
def test_feistel_in_tf_ops_yields_global_shuffle_order(n):
    expected = shuffle.full_order(shuffle.GlobalShuffle(n=n, seed=11, epoch=2))
    dataset = tfdata.index_dataset(shuffle.GlobalShuffle(n=n, seed=11, epoch=2))
    got = np.concatenate([b.numpy() for b in dataset.batch(8192)])
    np.testing.assert_array_equal(got, expected)


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["buffer", "global"])
def test_index_dataset_continues_a_shuffle_restored_from_its_state(algorithm):
    n, cut = 3000, 1234
    first = tfdata.make_shuffle(n, 200, 5, algorithm)
    stream = iter(first)
    head = [next(stream) for _ in range(cut)]
    resumed = tfdata.make_shuffle(n, 200, 5, algorithm)
    resumed.load_state_dict(shuffle.state_to_json(first.state_dict()))
    state_before = resumed.state_dict()
    tail = [int(x) for x in tfdata.index_dataset(resumed).as_numpy_iterator()]
    assert resumed.state_dict() == state_before  # building the dataset does not consume the shuffle
    np.testing.assert_array_equal(head + tail, shuffle.full_order(tfdata.make_shuffle(n, 200, 5, algorithm)))


def test_resumable_state_file_is_within_8_bytes_per_buffered_index_plus_4kb(tmp_path):
    rows = lab.measure_state_checkpoint([1, 100, 1000, 10_000], folder=tmp_path)
    for row in rows:
        assert row.exact_resume, row
        assert row.within_bound, f"{row.state_bytes} B > {row.bound_bytes} B for buffer {row.buffer_size}"


def test_fit_refuses_a_single_buffer_size():
    row = tfdata.CheckpointRow("tf.data shuffle", 10, False, 100, 1000, 0.0, 0.0, 0, 0, 0, 0, 0, True)
    with pytest.raises(ConfigError, match="buffer"):
        lab.fit_bytes_per_element([row])


def test_preflight_refuses_a_checkpoint_that_cannot_fit_with_the_numbers(tmp_path):
    with pytest.raises(BudgetExceeded, match=r"GB.*buffer_sizes"):
        tfdata.preflight_checkpoint(10**9, 500_000, tmp_path)
    tfdata.preflight_checkpoint(10, 16_000, tmp_path)  # small ones pass


@pytest.mark.slow
def test_tf_shuffle_and_the_resumable_buffer_have_the_same_quality_and_global_is_random():
    rows = lab.quality_vs_buffer(20_000, [100, 1000], episode_len=50, seed=1)
    by = {(r.algorithm, r.buffer_size): r for r in rows}
    for b in (100, 1000):
        tf_share = by["tf.data shuffle", b].same_episode_share
        resumable_share = by["resumable (buffer)", b].same_episode_share
        assert abs(tf_share - resumable_share) < 0.15 * tf_share + 0.003
        assert abs(by["tf.data shuffle", b].spearman - by["resumable (buffer)", b].spearman) < 0.01
    global_row = by["resumable (global)", 100]
    assert global_row.same_episode_share < 3 * global_row.same_episode_share_random
    assert abs(global_row.spearman) < 0.05


def test_buffer_needed_rule_matches_a_measured_shuffle():
    episode_len, target = 40, 0.02
    buffer_size = lab.buffer_needed(episode_len, target)
    order = shuffle.full_order(shuffle.ResumableShuffleBuffer(n=100_000, buffer_size=buffer_size, seed=0))
    measured = shuffle.same_episode_share(order, episode_len)
    assert 0.7 * target < measured < 1.3 * target
    with pytest.raises(ConfigError, match="target_share"):
        lab.buffer_needed(10, 1.5)


def test_checkpoint_and_quality_predicts_the_reference_row():
    fit = lab.BytesFit(bytes_per_element=16_200, fixed_bytes=500, sample_bytes=15_987, symbolic=True)
    numbers = lab.checkpoint_and_quality(250_000, 500, episode_len=100, fit=fit)
    assert 124e9 < numbers["tf_checkpoint_bytes"] < 126e9
    assert numbers["state_bytes"] <= 8 * 250_000 + 4096
    assert numbers["ratio"] > 10_000


def test_widget_panel_shows_checkpoint_sizes_and_quality_for_its_settings():
    from nblib import widgets

    fit = lab.BytesFit(bytes_per_element=16_200, fixed_bytes=500, sample_bytes=15_987, symbolic=True)
    panel = widgets.shuffle_checkpoint_panel(fit, buffer_size=10_000, sample_kb=150, episode_len=100)
    assert "tf.data checkpoint" in panel.text
    slider = panel.children[0].children[1]  # sample kB
    slider.value = 300
    text = panel.text
    assert "x 300,000 B samples" in text or "x 299," in text or "x 300," in text


@pytest.mark.slow
def test_only_shuffle_keeps_its_buffer_under_symbolic_checkpointing(tmp_path):
    rows = lab.measure_ops(SMALL_KB, n=128, folder=tmp_path)
    sample_bytes = tfdata.PipelineSpec(sample_kb=SMALL_KB).sample_bytes
    for row in rows:
        if row.symbolic and "shuffle" in row.pipeline:
            assert row.bytes_on_disk >= 30 * sample_bytes, row  # the buffer's 32 samples, minus what was emitted
        elif row.symbolic:
            assert not row.error and row.bytes_on_disk < 4096, row
    plain = {r.pipeline: r for r in rows if not r.symbolic}
    assert "stateful" in plain["range -> map(numpy_function)"].error
    # elements in flight are written: how many the prefetch thread had made by the save is timing (3 of 8 seen on
    # a busy machine), so at least one, against the few bytes of a symbolic checkpoint above
    assert plain["range -> map -> prefetch(8)"].bytes_on_disk > sample_bytes


@pytest.mark.slow
def test_a_real_tf_data_save_peaks_at_the_budget_models_disk(tmp_path):
    """The budget's temporary-space figure is what TensorFlow takes: 1x on a first save, 2x keeping the last."""
    rows = lab.measure_checkpoint([300], SMALL_KB, symbolic=(False, True), folder=tmp_path)
    for row in rows:
        assert not row.error and row.bytes_on_disk >= row.buffer_bytes
        first = budget.checkpoint_disk_peak(row.bytes_on_disk, keep_previous=False)
        kept = budget.checkpoint_disk_peak(row.bytes_on_disk, keep_previous=True)
        assert row.peak_disk_bytes == pytest.approx(first, rel=0.1), row
        assert row.peak_disk_rotating_bytes == pytest.approx(kept, rel=0.1), row
    model = lab.disk_model_checks(rows)
    assert [c.verdict for c in model] == ["right", "right"]
    fit = lab.BytesFit(bytes_per_element=500_100, fixed_bytes=0, sample_bytes=500_000, symbolic=True)
    claims = {c.claim: c for c in lab.reference_checks(fit, rows)}
    assert claims["peak disk, first save"].verdict == "wrong"           # the reference's 1.5-2x
    assert claims["peak disk, previous checkpoint kept"].verdict == "right"


def test_check_verdicts_follow_the_tolerance_for_values_and_ranges():
    assert lab.Check("x", "reference", (1.5, 2.0), 1.0, "x checkpoint").verdict == "wrong"
    assert lab.Check("x", "reference", (1.5, 2.0), 2.1, "x checkpoint").verdict == "right"
    assert lab.Check("x", "budget model", 1.0, 1.09, "x checkpoint").verdict == "right"
    assert lab.Check("x", "budget model", 1.0, 1.09, "x checkpoint", tolerance=0.05).verdict == "wrong"


def test_preflight_checkpoint_asks_for_the_disk_of_the_budget_model(tmp_path):
    from nblib.disk import disk_free

    free = disk_free(tmp_path)
    sample_bytes = 1_000_000
    buffer_size = int(free * 0.75 // sample_bytes)  # 1x fits, the model's 2x (previous kept) does not
    with pytest.raises(BudgetExceeded, match="new \\+ previous checkpoint"):
        tfdata.preflight_checkpoint(buffer_size, sample_bytes, tmp_path)


# ------------------------------------------------------- tf.data's own shuffles, beside nblib's


def test_builtin_shuffles_are_complete_permutations_with_the_same_samples():
    spec = tfdata.PipelineSpec(n_samples=300, sample_kb=1, buffer_size=50, seed=3, batch_size=0, prefetch=0)
    orders = {}
    for method in tfdata.SHUFFLE_METHODS:
        elements = list(tfdata.shuffle_pipeline(spec, method))
        orders[method] = [int(e["index"]) for e in elements]
        assert sorted(orders[method]) == list(range(300)), method
        first = elements[0]
        expected = tfdata.synthetic_image(first["index"], spec).numpy()
        assert np.array_equal(first["image"].numpy(), expected), method     # a pure function of the index
    assert orders[tfdata.TF_SHUFFLE] == tfdata.tf_shuffle_order(300, 50, 3).tolist()
    assert orders["resumable (global)"] == shuffle.full_order(tfdata.make_shuffle(300, 50, 3, "global")).tolist()
    assert len({tuple(o) for o in orders.values()}) == len(orders)          # five different orders


@pytest.mark.slow
def test_builtins_table_measures_checkpoint_bytes_exact_resume_and_throughput(tmp_path):
    spec = tfdata.PipelineSpec(n_samples=600, sample_kb=SMALL_KB, buffer_size=300, seed=0, batch_size=4)
    rows = {r.method: r for r in lab.compare_shuffles(spec, tmp_path / "cmp", cut_after=5, compared=10)}
    assert set(rows) == set(tfdata.SHUFFLE_METHODS) and not any(r.skipped for r in rows.values())
    buffer_bytes = 300 * spec.sample_bytes
    tf_row = rows[tfdata.TF_SHUFFLE]
    assert tf_row.symbolic_bytes > 0.9 * buffer_bytes and tf_row.plain_bytes > 0.9 * buffer_bytes
    for name, row in rows.items():
        assert row.exact_plain and row.exact_symbolic, name
        assert row.samples_per_s > 0, name
        if name != tfdata.TF_SHUFFLE:
            assert row.symbolic_bytes < 4096 < buffer_bytes, name        # a cursor, not a buffer
    assert rows["resumable (buffer)"].same_order_in_numpy and rows["resumable (global)"].same_order_in_numpy
    assert rows[tfdata.TF_GLOBAL_SHUFFLE].same_order_in_numpy is None
    global_needs = rows[tfdata.TF_GLOBAL_SHUFFLE].needs
    assert "private API" in global_needs and "TF >= 2.17" in global_needs and "random access" in global_needs
    assert rows[tfdata.TF_SHUFFLE].needs.startswith("any stream")
    table, conclusion = lab.builtins_table(rows.values()), lab.builtins_conclusion(rows.values())
    assert all(name in table for name in rows) and "Exact resume (plain and symbolic): 5 of 5." in conclusion
    assert (tmp_path / "cmp").exists() is False                              # every checkpoint is deleted


def test_missing_global_shuffle_is_skipped_with_a_note(tmp_path, monkeypatch):
    tfdata.tensorflow()
    monkeypatch.setitem(sys.modules, "tensorflow.python.data.experimental.ops.global_shuffle_op", None)
    assert tfdata.global_shuffle_op() is None                                # what TF < 2.17 gives
    spec = tfdata.PipelineSpec(n_samples=40, sample_kb=1, buffer_size=10, batch_size=4)
    with pytest.raises(ConfigError, match=r"needs TensorFlow >= 2.17"):
        tfdata.shuffle_pipeline(spec, tfdata.TF_GLOBAL_SHUFFLE)
    row, = lab.compare_shuffles(spec, tmp_path, methods=(tfdata.TF_GLOBAL_SHUFFLE,))
    assert row.skipped.startswith("skipped: TensorFlow") and "added in 2.17" in row.skipped
    assert "skipped: TensorFlow" in lab.builtins_table([row]) and "skipped" in lab.builtins_conclusion([row])


def test_global_shuffle_refuses_a_source_without_random_access():
    spec = tfdata.PipelineSpec(n_samples=40, sample_kb=1, buffer_size=10, batch_size=4, sources=2)
    if tfdata.global_shuffle_op() is None:
        pytest.skip("this TensorFlow has no global shuffle")
    with pytest.raises(Exception, match="(?i)random access"):          # interleave cannot be read by index
        next(iter(tfdata.shuffle_pipeline(spec, tfdata.TF_GLOBAL_SHUFFLE)))
