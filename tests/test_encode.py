"""Streaming encode: resume after SIGKILL to identical bytes, damaged files recomputed, a failing
mirror loses nothing, changed inputs refused. Real caches, real stores, real processes.
"""
from __future__ import annotations

import errno
import logging
import random
import re
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
from cli_runner import run_nblib

from conftest import small_cache, subprocess_env
from nblib import encode as enc
from nblib.atomic import sha256_file
from nblib.cache import ShardedImageCache, populate
from nblib.config import preset
from nblib.encode.layout import part_name
from nblib.errors import ConfigError, ResumeMismatch, StateError
from nblib.lab import streaming_encoding as lab
from nblib.manifest import read_stat_cache
from nblib.store import DurableStore, FileOps, MirrorWarning
from nblib.trm import TRMVisionEncoder

N_TEXTS = 256
SMOKE = preset("smoke")
# One thread in every process that encodes: same threads -> same kernels -> same bytes, and
# no oversubscription on a loaded 2-core machine.
THREADS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _texts(n: int, salt: str = "") -> list[str]:
    words = ["streaming", "encoders", "resume", "after", "a", "kill", "without", "losing", "a", "single", "byte"]
    return [f"{salt}#{i} " + " ".join(words[(i * 7 + j) % len(words)] for j in range(3 + i % 5))
            for i in range(n)]


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread(one_torch_thread):
    """Every test of this module encodes with one torch thread."""


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    """A real 256-image cache at smoke size, cut into 7 shards (batches cross shard borders)."""
    folder = tmp_path_factory.mktemp("cache") / "c"
    return small_cache(folder, _texts(N_TEXTS))


@pytest.fixture(scope="module")
def reference(cache_dir, tmp_path_factory) -> dict[str, str]:
    """sha256 of the consolidated files of one uninterrupted in-process run (smoke, batch 16)."""
    report = enc.encode(ShardedImageCache(cache_dir), tmp_path_factory.mktemp("ref"), _cfg(),
                        progress=False, preflight=False)
    return {name: sha256_file(path) for name, path in report.outputs.items()}


def _cfg(**changes):
    return SMOKE.replace(batch_size=16, checkpoint_every=2, consolidate_every=1, **changes)


def _run(cache_dir, run_dir, **kwargs):
    kwargs.setdefault("progress", False)
    kwargs.setdefault("preflight", False)
    return enc.encode(ShardedImageCache(cache_dir), run_dir, kwargs.pop("config", _cfg()), **kwargs)


def _hashes(report) -> dict[str, str]:
    return {name: sha256_file(path) for name, path in report.outputs.items()}


# ---------------------------------------------------------------------------- kill and resume


# What `_cli` asks for, as a config: the in-process runs below use it as the uninterrupted twin.
CLI_CONFIG = SMOKE.replace(batch_size=8, checkpoint_every=1, consolidate_every=1)


def _cli(cache_dir: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "nblib", "encode", "--cache", str(cache_dir), "--out", str(out),
            "--profile", "smoke", "--batch-size", "8", "--checkpoint-every", "1", "--no-progress",
            *extra]


def _durable_parts(out: Path) -> int:
    return len(list((out / enc.PARTS_FOLDER).glob("part-*/part.json")))


@pytest.mark.slow
def test_cli_killed_three_times_at_random_points_resumes_to_identical_bytes(cache_dir, tmp_path):
    env = subprocess_env(**THREADS)
    whole = _run(cache_dir, tmp_path / "whole", config=CLI_CONFIG)   # uninterrupted, same settings

    killed = tmp_path / "killed"
    rng = random.Random(20261122)
    n_parts = N_TEXTS // 8
    targets = sorted(rng.sample(range(1, n_parts - 2), 3))
    for target in targets:
        proc = subprocess.Popen(_cli(cache_dir, killed), env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE)
        deadline = time.monotonic() + 240
        while _durable_parts(killed) < target and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.002)
        pause_until = time.monotonic() + rng.uniform(0, 0.3)   # land anywhere: mid-batch, mid-write, mid-manifest,
        while time.monotonic() < pause_until and _durable_parts(killed) < n_parts - 1:   # but before the last part
            time.sleep(0.002)                  # (an idle machine encoded the rest in 0.3 s: nothing left to resume)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(30) == -signal.SIGKILL, proc.stderr.read().decode()
        assert not (killed / enc.INDEX_NAME).exists(), "the run finished before the kill"

    resumed = run_nblib(*_cli(cache_dir, killed)[3:], **THREADS)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed at sample" in resumed.stdout
    for name in ("sketches", "checksums", "children"):
        assert sha256_file(killed / f"{name}.npy") == sha256_file(whole.outputs[name]), name
    index = enc.read_index(killed)
    assert [p["range"] for p in index["parts"].values()] == [[8 * k, 8 * k + 8] for k in range(n_parts)]


@pytest.mark.slow
def test_cli_refuses_to_resume_a_run_made_with_other_settings_and_exits_2(cache_dir, tmp_path):
    _run(cache_dir, tmp_path / "r", config=CLI_CONFIG.replace(outputs=("sketches",)))
    assert sorted(p.name for p in (tmp_path / "r").glob("*.npy")) == ["sketches.npy"]
    second = run_nblib(*_cli(cache_dir, tmp_path / "r", "--outputs", "sketches,children")[3:], **THREADS)
    assert second.returncode == 2
    assert "outputs: ['sketches'] -> ['sketches', 'children']" in second.stderr
    assert "Traceback" not in second.stderr


def test_in_process_run_matches_itself_and_both_offload_modes_agree(cache_dir, reference, tmp_path):
    report = _run(cache_dir, tmp_path / "c", offload="consolidate")
    assert _hashes(report) == reference
    assert report.parts_encoded == report.parts_total == 8


def test_rerun_of_a_complete_run_encodes_nothing(cache_dir, reference, tmp_path):
    _run(cache_dir, tmp_path / "r")
    again = _run(cache_dir, tmp_path / "r")
    assert again.parts_encoded == 0 and _hashes(again) == reference
    assert str(again).startswith(f"already complete: {again.parts_total} of {again.parts_total} parts")


def test_resume_after_a_partial_run_recomputes_only_the_missing_parts(cache_dir, reference, tmp_path, caplog):
    _run(cache_dir, tmp_path / "r", do_consolidate=False)
    store = enc.open_store(tmp_path / "r")
    for k in range(3, 8):
        store.delete_part(part_name(k))
    with caplog.at_level(logging.WARNING, logger="nblib"):
        resumed = _run(cache_dir, tmp_path / "r")
    assert re.search("part-000003.*recomputed", caplog.text)
    assert resumed.parts_encoded == 5 and resumed.resumed_at == 3 * 32
    assert _hashes(resumed) == reference


# ---------------------------------------------------------------------------- damaged files


def test_truncated_part_is_detected_and_recomputed(cache_dir, reference, tmp_path, caplog):
    _run(cache_dir, tmp_path / "r", do_consolidate=False)
    victim = tmp_path / "r" / enc.PARTS_FOLDER / "part-000002" / "children.npy"
    with open(victim, "r+b") as f:
        f.truncate(victim.stat().st_size // 2)
    with caplog.at_level(logging.WARNING, logger="nblib"):
        resumed = _run(cache_dir, tmp_path / "r")
    assert "part-000002" in caplog.text
    assert resumed.parts_encoded == 1 and resumed.resumed_at == 2 * 32
    assert _hashes(resumed) == reference


def test_half_written_manifest_is_detected_and_rebuilt_from_the_parts(cache_dir, reference, tmp_path, caplog):
    _run(cache_dir, tmp_path / "r", do_consolidate=False)
    manifest = tmp_path / "r" / enc.PARTS_FOLDER / "manifest.json"
    manifest.write_bytes(manifest.read_bytes()[: manifest.stat().st_size // 2])
    with caplog.at_level(logging.WARNING, logger="nblib"):
        resumed = _run(cache_dir, tmp_path / "r")
    assert "manifest" in caplog.text
    assert resumed.parts_encoded == 0, "the durable parts were kept, not recomputed"
    assert _hashes(resumed) == reference


def test_consolidate_refuses_an_incomplete_run_with_the_counts(cache_dir, tmp_path):
    _run(cache_dir, tmp_path / "r", do_consolidate=False)
    enc.open_store(tmp_path / "r").delete_part("part-000007")
    with pytest.raises(StateError, match=r"not complete"):
        enc.consolidate(tmp_path / "r")


def test_index_names_each_part_range_and_the_hashes_of_its_arrays(cache_dir, tmp_path):
    report = _run(cache_dir, tmp_path / "r")
    index = enc.read_index(tmp_path / "r")
    sketches = np.load(report.outputs["sketches"])
    with enc.open_store(tmp_path / "r") as store:
        stored = {p.name: p for p in store.list_parts()}
        for name, part in index["parts"].items():     # the part files each output was built from
            start, stop = part["range"]
            assert part["sha256"] == {o: stored[name].files[o].sha256 for o in report.outputs}
            assert np.array_equal(store.read_part(name)["sketches"], sketches[start:stop])
    for name, path in report.outputs.items():   # hashed while written, equal to the file's bytes
        entry = index["files"][name]
        assert entry["sha256"] == sha256_file(path), name
        assert entry["bytes"] == path.stat().st_size and "mtime_ns" not in entry   # deterministic index
        assert read_stat_cache(path.parent / enc.INDEX_NAME)[name]["mtime_ns"] == path.stat().st_mtime_ns
    assert sketches.dtype == np.float16 and sketches.shape == (N_TEXTS, 4, 64)
    assert not list((tmp_path / "r").glob(".tmp-*"))


def test_outputs_match_the_encoder_run_directly_on_the_same_batches(cache_dir, tmp_path):
    import torch

    report = _run(cache_dir, tmp_path / "r", out_dtype="float32", outputs=("checksums",))
    cache = ShardedImageCache(cache_dir)
    model = TRMVisionEncoder(_cfg(), seed=0)
    direct = model.encode(torch.from_numpy(cache.get_batch(16, 32)))["checksums"].numpy()
    assert np.array_equal(np.load(report.outputs["checksums"])[16:32], direct)
    assert list(report.outputs) == ["checksums"]


# ---------------------------------------------------------------------------- mirror failures


class FlakyDrive(FileOps):
    """Mirror-side file calls that fail like a dropped Drive mount (Errno 107).

    "flaky": every 29th call fails (a retry gets through); "down": every call fails;
    `down_after_parts`: the mount drops for good once that many parts reached the mirror.
    """

    def __init__(self, mode: str = "ok", down_after_parts: int | None = None):
        self.mode, self.down_after_parts = mode, down_after_parts
        self.calls = self.failures = self.parts_mirrored = 0

    def _maybe_fail(self):
        self.calls += 1
        if self.mode == "down" or (self.mode == "flaky" and self.calls % 29 == 0):
            self.failures += 1
            raise OSError(errno.ENOTCONN, "Transport endpoint is not connected")

    def open(self, path, mode="rb"):
        self._maybe_fail()
        return super().open(path, mode)

    def write_atomic(self, path, blocks, expect_digest=None, **options):
        self._maybe_fail()
        written = super().write_atomic(path, blocks, expect_digest, **options)
        self._landed(path)
        return written

    def replace(self, src, dst):
        self._maybe_fail()
        super().replace(src, dst)
        self._landed(dst)

    def listdir(self, path):
        self._maybe_fail()
        return super().listdir(path)

    def stat(self, path):
        self._maybe_fail()
        return super().stat(path)

    def _landed(self, path) -> None:
        """A part is on the mirror once its part.json is (written last); count it."""
        if Path(path).name == "part.json":
            self.parts_mirrored += 1
            if self.parts_mirrored == self.down_after_parts:
                self.mode = "down"


def _store(run_dir: Path, mirror: Path, ops: FileOps) -> DurableStore:
    return DurableStore(run_dir / enc.PARTS_FOLDER, mirror, _ops=ops, retries=2, backoff_s=0.001,
                        retry_interval_s=0.2, remount=lambda: None)


def test_intermittent_mirror_failures_are_retried_and_the_mirror_catches_up(cache_dir, reference, tmp_path):
    drive, mirror = FlakyDrive("flaky"), tmp_path / "drive"
    with _store(tmp_path / "r", mirror, drive) as store:
        report = _run(cache_dir, tmp_path / "r", store=store)
        assert store.flush(timeout=60) and store.mirror_lag == 0
    assert drive.failures >= 2, "the flaky mirror did fail along the way"
    assert _hashes(report) == reference
    with DurableStore(tmp_path / "elsewhere", mirror) as mirror_only:
        assert len(mirror_only.list_parts()) == 8


@pytest.mark.slow
def test_mirror_down_for_good_mid_run_loses_nothing_and_catches_up_when_back(cache_dir, reference, tmp_path):
    drive, mirror = FlakyDrive(down_after_parts=2), tmp_path / "drive"
    store = _store(tmp_path / "r", mirror, drive)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = _run(cache_dir, tmp_path / "r", store=store)
        assert store.flush(timeout=5) is False
    warned = [str(w.message) for w in caught if issubclass(w.category, MirrorWarning)]
    assert warned and "continues locally" in warned[0], "a clear warning"
    assert _hashes(report) == reference, "the run completed locally"
    assert store.mirror_lag >= 5, "the parts after the drop wait locally"
    store.close(timeout=0.5)

    drive.mode = "ok"                               # Drive is back: a new store resyncs
    with _store(tmp_path / "r", mirror, drive) as back:
        assert back.flush(timeout=60) and back.mirror_lag == 0
    with DurableStore(tmp_path / "elsewhere", mirror) as mirror_only:
        assert len(mirror_only.list_parts()) == 8
        again = enc.consolidate(tmp_path / "from-mirror", store=mirror_only)
    assert {n: sha256_file(p) for n, p in again.items()} == reference


# ---------------------------------------------------------------------------- changed inputs


def test_changed_config_is_refused_naming_the_setting(cache_dir, tmp_path):
    _run(cache_dir, tmp_path / "r", do_consolidate=False)
    with pytest.raises(ResumeMismatch, match=r"batch_size: 16 -> 32.*new --out folder"):
        _run(cache_dir, tmp_path / "r", config=_cfg().replace(batch_size=32))
    with pytest.raises(ResumeMismatch, match=r"model.dim: 64 -> 32"):
        _run(cache_dir, tmp_path / "r", config=_cfg(dim=32))


def test_changed_weights_are_refused(cache_dir, tmp_path):
    _run(cache_dir, tmp_path / "r", do_consolidate=False)
    other = TRMVisionEncoder(_cfg(), seed=99).save_weights(tmp_path / "trained.pt")
    with pytest.raises(ResumeMismatch, match="weights changed"):
        _run(cache_dir, tmp_path / "r", weights=other)


def test_changed_cache_is_refused(cache_dir, tmp_path):
    _run(cache_dir, tmp_path / "r", do_consolidate=False)
    other = tmp_path / "other-cache"
    populate(_texts(N_TEXTS, salt="other"), other, image_size=64, shard_mb=0.5, workers=0, progress=False)
    with pytest.raises(ResumeMismatch, match="cache changed"):
        _run(other, tmp_path / "r")


def test_loader_knobs_may_change_between_a_run_and_its_resume(cache_dir, reference, tmp_path, caplog):
    _run(cache_dir, tmp_path / "r", do_consolidate=False)
    enc.open_store(tmp_path / "r").delete_part("part-000005")
    with caplog.at_level(logging.WARNING, logger="nblib"):
        resumed = _run(cache_dir, tmp_path / "r", config=_cfg(workers=1, prefetch=3), offload="consolidate")
    assert "part-000005" in caplog.text
    assert resumed.parts_encoded == 1 and _hashes(resumed) == reference


def test_cache_of_another_image_size_is_refused_with_both_sizes(cache_dir, tmp_path):
    with pytest.raises(ConfigError, match=r"64x64 images.*expects 224x224"):
        _run(cache_dir, tmp_path / "r", config=preset("t4"))


def test_unknown_offload_mode_is_refused(cache_dir, tmp_path):
    with pytest.raises(ConfigError, match="offload"):
        _run(cache_dir, tmp_path / "r", offload="gpu")


# ---------------------------------------------------------------------------- looking at outputs


def test_identical_images_collide_and_distinct_ones_rarely_do():
    rng = np.random.default_rng(0)
    checksums = rng.standard_normal((64, 4, 8)).astype(np.float16)
    checksums[10] = checksums[3]
    report = lab.checksum_collisions(checksums, image_hashes=[str(i) for i in range(64)])
    assert report.colliding_samples == 2 and report.distinct_codes == 63
    assert (report.hamming == 0).sum() == 1 and report.hamming.max() <= 32


def test_sketch_projection_keeps_the_main_direction():
    rng = np.random.default_rng(1)
    direction = rng.standard_normal(16)
    sketches = (rng.standard_normal((200, 2, 1)) * 10 * direction + rng.standard_normal((200, 2, 16)) * 0.1)
    coords, explained = lab.sketch_projection(sketches)
    assert coords.shape == (200, 2, 2) and explained[0] > 0.95


def test_the_encode_bar_counts_a_small_run_in_whole_images():
    """60 images read '12/60', not tqdm's scaled '12.0/60.0' (newcomer P27)."""
    from types import SimpleNamespace

    from nblib.encode.run import _progress_bar

    bar = _progress_bar(SimpleNamespace(n_samples=60), {"samples_done": 12}, True)
    try:
        assert "| 12/60 [" in str(bar), str(bar)
    finally:
        bar.close()
