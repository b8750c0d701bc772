"""`python -m nblib train` killed with SIGKILL at random points and rerun: the final weights are the
uninterrupted run's, bit for bit, with 0 or 2 loader workers, from the local folder, from a mirror
folder alone, and from a real S3 server (moto) alone; a dead bucket never blocks training; two
torchrun ranks killed and resumed give the unkilled launch's bytes, each rank drawing its own dropout and the
resume drawing the same; 2 ranks -> 1 continues the global sample order with no sample skipped or repeated.
Real processes, real files, real ranks.
"""
from __future__ import annotations

import os
import random
import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest
import torch
from test_train import assert_same_weights, weights_of
from train_runs import (
    TWO_RANK_STEPS,
    assert_the_bucket_alone_resumes_exactly,
    build_two_rank_runs,
    cache_and_reference,
    free_port,
    run_and_kill,
    run_train,
    train_cli,
    train_env,
)

pytestmark = pytest.mark.slow


cache_dir, reference = cache_and_reference("resume")


@pytest.mark.parametrize("workers", [0, 2])
def test_sigkill_at_random_points_then_rerun_gives_the_uninterrupted_weights(cache_dir, reference, tmp_path, workers):
    out = tmp_path / "run"
    cmd = train_cli(cache_dir, out, "--workers", str(workers))
    rng = random.Random(workers)
    first = rng.randrange(2, 6)
    for target in (first, rng.randrange(first + 1, 8)):         # the newest saved step when the kill comes
        run_and_kill(cmd, out, after_step=target, extra_s=rng.uniform(0, 0.05))
    assert not (out / "final.pt").exists()
    done = run_train(cmd)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from local" in done.stdout
    assert_same_weights(weights_of(out), reference)


def test_only_the_mirror_folder_survives_and_the_rerun_gives_the_same_weights(cache_dir, reference, tmp_path):
    out, mirror = tmp_path / "run", tmp_path / "drive"
    cmd = train_cli(cache_dir, out, "--mirror", str(mirror))
    run_and_kill(cmd, out, extra_s=0, mirrored=mirror)
    shutil.rmtree(out)                                           # a new VM: the local disk is gone
    done = run_train(cmd)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from mirror" in done.stdout
    assert_same_weights(weights_of(out), reference)


def test_a_real_s3_server_holds_the_backups_and_a_resume_from_the_bucket_alone_is_exact(cache_dir, reference,
                                                                                          tmp_path, moto):
    endpoint, fs = moto
    fs.mkdir("runs")
    assert_the_bucket_alone_resumes_exactly(cache_dir, reference, tmp_path / "run", fs, "s3://runs/exp1",
                                            train_env(**_aws(endpoint)))


def test_a_dead_bucket_never_blocks_training_and_the_report_says_what_is_not_durable(cache_dir, tmp_path):
    port = free_port()                                           # nothing listens there: every request fails
    out = tmp_path / "run"
    cmd = train_cli(cache_dir, out, "--mirror", "s3://gone/exp", "--mirror-timeout", "2")
    done = subprocess.run(cmd, env=train_env(**_aws(f"http://127.0.0.1:{port}")), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "NOT YET DURABLE" in done.stdout and "step 12" in done.stdout, done.stdout
    assert (out / "final.pt").exists()


# ------------------------------------------------------------------------------ torchrun ranks


def test_two_ranks_killed_and_resumed_give_the_unkilled_launchs_bytes(two_rank_runs):
    runs = two_rank_runs                      # torchrun: whole; killed after step 4 (ranks + torchrun), rerun
    assert "resumed from local" in runs.resumed_stdout
    assert_same_weights(weights_of(runs.killed), weights_of(runs.whole))
    assert not list((runs.killed / "checkpoints").glob(".tmp-*"))


def test_two_ranks_then_one_continue_the_global_order_with_no_sample_skipped_or_repeated(two_rank_runs, tmp_path):
    from nblib.manifest import read_manifest
    from nblib.train.loop import REPORT, REPORT_KIND

    out = tmp_path / "run"
    shutil.copytree(two_rank_runs.killed_snapshot, out)          # 2 ranks, SIGKILLed once step 4 was saved
    first = {p.name for p in (out / "samples").glob("*.txt")}
    steps = TWO_RANK_STEPS
    done = run_train(train_cli(two_rank_runs.cache_dir, out, "--steps", str(steps), "--device", "cpu"),
                     NBLIB_TRAIN_SAMPLE_LOG="1")
    assert done.returncode == 0, done.stderr[-3000:]
    start = read_manifest(out / REPORT, REPORT_KIND).body["start_step"]
    assert 0 < start < steps
    counted: dict[int, list[int]] = {}
    for path in (out / "samples").glob("*.txt"):
        rerun = path.name not in first
        for line in path.read_text().splitlines():
            step, indices = line.split(":")
            if (int(step) > start) == rerun:                      # the steps each run's state kept
                counted.setdefault(int(step), []).extend(int(i) for i in indices.split())
    assert sorted(counted) == list(range(1, steps + 1))
    n_train = 128                                                # 160 samples, 20% held out
    per_epoch = n_train // 16
    for epoch in range(steps // per_epoch):
        seen = [i for s in range(epoch * per_epoch + 1, (epoch + 1) * per_epoch + 1) for i in counted[s]]
        assert len(seen) == len(set(seen)) == n_train            # every sample once, none twice
    assert steps % per_epoch == 0


@pytest.mark.slow
def test_two_ranks_draw_their_own_dropout_and_a_killed_launch_resumes_each_ranks_draws(two_rank_runs):
    runs = two_rank_runs                      # torchrun: whole; killed after step 4 (ranks + torchrun), rerun
    assert "resumed from local" in runs.resumed_stdout
    assert_same_weights(weights_of(runs.killed), weights_of(runs.whole))
    drawn = _seeds(runs.whole)
    assert all(drawn[(step, 0)] != drawn[(step, 1)] for step in range(1, TWO_RANK_STEPS + 1))   # each rank its own
    assert _seeds(runs.killed) == drawn                         # every step the resume ran drew the same


# ------------------------------------------------------------------------------ helpers


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    """Two-rank torchrun launches the two-rank tests read (train_runs.two_rank_runs): whole; killed, resumed."""
    return build_two_rank_runs(tmp_path_factory.mktemp("two-ranks"))


def _seeds(out: Path) -> dict[tuple[int, int], int]:
    """(step, rank) -> the seed dropout drew from, over every process that ran in `out` (last one wins)."""
    seeds = {}
    for path in sorted((out / "samples").glob("*.seeds"), key=lambda p: p.stat().st_mtime):
        rank = int(path.name.split("-")[0].removeprefix("rank"))
        for line in path.read_text().splitlines():
            step, seed = line.split(":")
            seeds[(int(step), rank)] = int(seed)
    return seeds


@pytest.fixture
def moto():
    from moto.server import ThreadedMotoServer

    from nblib.train.objstore import open_filesystem

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    # moto keeps its buckets in this process, not in the server: start every test from none
    urllib.request.urlopen(urllib.request.Request(f"{endpoint}/moto-api/reset", method="POST"), timeout=30).close()
    saved = {k: os.environ.get(k) for k in _aws(endpoint)}
    os.environ.update(_aws(endpoint))
    try:
        yield endpoint, open_filesystem("s3")
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        server.stop()


def _aws(endpoint: str) -> dict[str, str]:
    return {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1"}



def test_reference_weights_are_real_tensors(reference):
    assert reference and all(isinstance(v, torch.Tensor) for v in reference.values())
