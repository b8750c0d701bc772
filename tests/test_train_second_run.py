"""Training beside a second run: one mirror (a folder, or an S3 bucket on moto's server) or one `--out`
shared by two runs. The first run trains in this process; at a step it starts the second, a real
`python -m nblib train`, and waits for it: the second is refused (one `error:` line, exit 2) naming
the folder that is taken, before it writes anything, and nothing of the first run is deleted or
overwritten. Also: a reader deletes no temporaries, the report after a resume from the mirror at the
last step, and `close()` interrupted by Ctrl-C leaves no thread running.
"""
from __future__ import annotations

import subprocess
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch
from test_train import FAST, labelled_cache
from test_train_resume import _aws, moto  # noqa: F401  (moto: the S3 server fixture)
from train_runs import run_train, train_cli, train_env

from nblib.store.mirror import Mirror
from nblib.train import train
from nblib.train.store import TrainStore

SECOND = ("--seed", "7")          # another run: other settings, so another identity


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return labelled_cache(tmp_path_factory.mktemp("second"), 160)


def _second_run(cache_dir: Path, out: Path, *extra: str, env=None):
    """The second run's command: in this process (cli_runner), or a real one where `env` names a server."""
    cmd = train_cli(cache_dir, out, *SECOND, *extra)
    if env is None:
        return run_train(cmd)
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


def _one_error_line(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 2, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, done.stderr[-3000:]
    return errors[0]


def _contents(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
            and not p.name.startswith(".lock-")}


def _kept(before: dict, after: dict) -> None:
    """Every file of `before` is in `after` with its bytes (the first run's mirror thread may add more)."""
    assert before and {k: after.get(k) for k in before} == before


def _during(step: int, action):
    """An on_step hook that runs `action()` once, at `step`, and keeps what it returned."""
    box: list = []

    def hook(at: int, report) -> None:
        if at == step and not box:
            box.append(action())
    return hook, box


def _states_are_the_first_runs(folder: Path, seed: int = 0) -> None:
    states = sorted(folder.glob("state-*.pt"))
    assert states
    for path in states:
        assert torch.load(path, weights_only=True)["identity"]["config"]["seed"] == seed, path.name


def test_a_second_run_on_the_same_mirror_folder_is_refused_naming_the_mirror_and_nothing_is_overwritten(
        cache_dir, tmp_path):
    mirror = tmp_path / "drive" / "backup"
    seen: dict = {}

    def second():
        seen["before"] = _contents(mirror)
        done = _second_run(cache_dir, tmp_path / "run-b", "--mirror", str(mirror))
        seen["after"] = _contents(mirror)
        return done

    hook, box = _during(4, second)
    report = train(cache_dir, tmp_path / "run-a", FAST, mirror=str(mirror), on_step=hook)
    line = _one_error_line(box[0])
    assert str(mirror) in line and "--mirror" in line and "--out" not in line, line
    _kept(seen["before"], seen["after"])
    assert f"mirror holds step {FAST.steps}" in report.durability.line()
    _states_are_the_first_runs(mirror / "checkpoints")
    assert not (tmp_path / "run-b" / "checkpoints").exists() or not list((tmp_path / "run-b").rglob("state-*"))


def test_a_second_run_on_the_same_bucket_prefix_is_refused_naming_the_bucket(cache_dir, tmp_path, moto):  # noqa: F811
    endpoint, fs = moto
    fs.mkdir("runs")
    url = "s3://runs/exp"
    seen: dict = {}

    def listing() -> dict[str, bytes]:
        return {p: fs.cat_file(p) for p in fs.find("runs/exp")}

    def second():
        seen["before"] = listing()
        done = _second_run(cache_dir, tmp_path / "run-b", "--mirror", url, env=train_env(**_aws(endpoint)))
        seen["after"] = listing()
        return done

    hook, box = _during(4, second)
    report = train(cache_dir, tmp_path / "run-a", FAST, mirror=url, on_step=hook)
    line = _one_error_line(box[0])
    assert "runs/exp" in line and "--out" not in line, line
    assert seen["before"]
    _kept(seen["before"], seen["after"])
    assert f"mirror holds step {FAST.steps}" in report.durability.line()
    for path in fs.find("runs/exp/checkpoints"):
        if path.endswith(".pt") and "/state-" in path:
            assert torch.load(fs.open(path), weights_only=True)["identity"]["config"]["seed"] == 0


def test_a_second_run_on_the_same_out_folder_is_refused_before_it_writes_anything(cache_dir, tmp_path):
    out = tmp_path / "run"
    seen: dict = {}

    def second():
        seen["before"] = _contents(out)
        done = _second_run(cache_dir, out)
        seen["after"] = _contents(out)
        return done

    hook, box = _during(3, second)
    report = train(cache_dir, out, FAST, on_step=hook)
    line = _one_error_line(box[0])
    assert str(out) in line and "lock" in line, line
    assert seen["after"] == seen["before"]
    assert report.final is not None
    payload = torch.load(out / "final.pt", weights_only=True)
    assert payload["train"]["seed"] == 0
    _states_are_the_first_runs(out / "checkpoints")
    assert not list(out.glob(".lock-*"))                         # released at the end


def test_a_reader_never_deletes_a_live_writers_temporary(cache_dir, tmp_path):
    from nblib.atomic import AtomicWriter
    from nblib.lab.training import newest_state

    out = tmp_path / "run"
    train(cache_dir, out, FAST.replace(steps=2))
    writer = TrainStore(out, sync_save=True)
    try:
        live = AtomicWriter(out / "checkpoints" / "state-000004.pt")   # a write in flight
        live.write(b"half of a state")
        assert newest_state(out)["step"] == 2
        TrainStore(out, start_mirror=False).load_latest()
        assert live.temporary.exists()
        live.write(b", the other half")
        assert live.commit().path.read_bytes() == b"half of a state, the other half"
    finally:
        writer.close(0)


def test_after_a_resume_from_the_mirror_at_the_last_step_the_report_says_the_mirror_holds_it(cache_dir, tmp_path):
    mirror = tmp_path / "backup"
    train(cache_dir, tmp_path / "run", FAST, mirror=str(mirror))
    again = train(cache_dir, tmp_path / "fresh-vm", FAST, mirror=str(mirror))
    assert again.resumed_from == "mirror" and again.start_step == FAST.steps
    line = again.durability.line()
    assert line.startswith(f"mirror holds step {FAST.steps}"), line
    assert "locally only" not in line and "local only" not in line and "the newest" in line   # P17


def test_the_durability_line_names_the_local_only_steps_only_when_there_are_some():
    from nblib.train.store import Durability

    assert "local only" not in Durability(30, 30, True, False, None).line()       # the last step is mirrored
    behind = Durability(35, 30, True, False, None).line()
    assert "after it (to 35) are local only" in behind and "the newest" not in behind


def test_ctrl_c_during_close_leaves_no_writer_or_mirror_thread_running(tmp_path, monkeypatch):
    earlier = set(threading.enumerate())      # other tests of this worker may leave stalled mirrors behind
    store = TrainStore(tmp_path / "run", tmp_path / "backup")
    state = {"step": 1, "model": {"w": torch.ones(3)}}
    store.save(state, 1, backup=True)
    names = ("nblib-store-mirror", "nblib-checkpoint-writer", "nblib-train-writer")

    def ours() -> list[str]:
        return [t.name for t in threading.enumerate() if t.name in names and t not in earlier]

    assert ours(), "the store started no thread: the test would prove nothing"

    def interrupted(self, timeout=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(Mirror, "wait", interrupted)
    with pytest.raises(KeyboardInterrupt):
        store.close(5)
    deadline = time.monotonic() + 30
    while ours() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not ours()


def test_async_staging_reuses_one_set_of_buffers_and_writes_the_bytes_of_a_sync_save(tmp_path):
    from nblib.store.manager import CheckpointManager

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    weights = model.state_dict()
    state = {"model": weights, "tied": weights["0.weight"][1:], "history": [{"step": 1}]}
    sync = CheckpointManager(tmp_path / "sync")
    manager = CheckpointManager(tmp_path / "async")
    for version in (1, 2, 3):
        sync.save({"state": state}, version)
        manager.save({"state": state}, version, blocking=False)
    manager.wait()
    assert manager._staging.allocations == 1                     # one snapshot, reused
    for version in (1, 2, 3):
        name = f"state-{version:06d}.pt"
        assert (tmp_path / "async" / name).read_bytes() == (tmp_path / "sync" / name).read_bytes()
    sync.close()
    manager.close()


def test_the_next_async_save_waits_for_the_write_in_flight_before_it_stages(tmp_path, monkeypatch):
    from nblib.store.manager import CheckpointManager

    manager = CheckpointManager(tmp_path / "run")
    release, order = threading.Event(), []
    original_save, original_begin = manager.local.save, manager._staging.begin

    def held(obj, name, version):
        if version == 1:
            assert release.wait(60)
        order.append(f"wrote {version}")
        return original_save(obj, name, version)

    def begin(obj):
        order.append("staged")
        return original_begin(obj)

    manager.local.save, manager._staging.begin = held, begin
    state = {"w": torch.ones(4)}
    manager.save({"state": state}, 1, blocking=False)
    second = threading.Thread(target=lambda: manager.save({"state": state}, 2, blocking=False))
    second.start()
    time.sleep(0.3)
    assert order == ["staged"]                                   # the second save waits; it has not staged
    release.set()
    second.join(60)
    manager.wait()
    assert order == ["staged", "wrote 1", "staged", "wrote 2"]
    manager.close()


def test_a_failed_background_write_travels_in_its_future(tmp_path):
    from nblib.store.manager import CheckpointManager

    manager = CheckpointManager(tmp_path / "run")

    def broken(obj, name, version):
        raise OSError(28, "No space left on device")

    manager.local.save = broken
    future = manager.save({"state": {"w": torch.ones(2)}}, 5, blocking=False)
    with pytest.raises(OSError, match="No space left") as caught:
        future.result(60)
    assert any("5" in note for note in caught.value.__notes__)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        manager.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: staging into pinned buffers")
def test_on_cuda_an_async_save_writes_the_bytes_of_a_sync_save(tmp_path):
    from nblib.store.manager import CheckpointManager

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 4)).cuda()
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(8, 64, device="cuda")).sum().backward()
    optimizer.step()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    sync, manager = CheckpointManager(tmp_path / "sync"), CheckpointManager(tmp_path / "async")
    for version in (1, 2):
        sync.save({"state": state}, version)
        manager.save({"state": state}, version, blocking=False)
    manager.wait()
    assert manager._staging.allocations == 1
    for version in (1, 2):
        name = f"state-{version:06d}.pt"
        assert (tmp_path / "async" / name).read_bytes() == (tmp_path / "sync" / name).read_bytes()
    loaded = torch.load(tmp_path / "async" / "state-000002.pt", weights_only=True)
    assert all(t.device.type == "cpu" for t in loaded["model"].values())
    sync.close()
    manager.close()
