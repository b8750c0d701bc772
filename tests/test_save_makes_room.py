"""Issue 39, what a save costs the loop: a save removes the version its prune would remove before it writes
the new one (accelerate's `total_limit` order), so the new file's pages take the memory the old one's free.
Writing 210 MB into memory nothing freed cost this machine's kernel 0.3-0.5 s more a save
(benchmarks/save_loop_cost.py). Never the last complete version: with keep_last=1 the old one stays until
the new one is complete, and a SIGKILL at any moment leaves a complete newest version to resume from.
"""
from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from conftest import subprocess_env
from nblib.store import manager
from nblib.store.manager import CheckpointManager


def state(version: int) -> dict:
    return {"weights": torch.full((64, 64), float(version)), "step": version}


def versions_while_writing(store: CheckpointManager, monkeypatch, where: str) -> list:
    """The complete versions on disk each time `store.local.<where>` starts writing a new one."""
    seen, original = [], getattr(store.local, where)
    monkeypatch.setattr(store.local, where, lambda obj, name, version: (seen.append(store.local.versions(name)),
                                                                         original(obj, name, version))[1])
    return seen


@pytest.mark.parametrize("path", ["sync", "async on a writer thread", "async serialized on the caller's thread"])
def test_the_oldest_version_goes_before_the_new_one_is_written_and_keep_last_remain_after(tmp_path, monkeypatch,
                                                                                          path):
    monkeypatch.setattr(manager.SpareCore, "none_spare", lambda self: path.endswith("caller's thread"))
    store = CheckpointManager(tmp_path, keep_last=3)
    for version in (1, 2, 3):
        store.save({"state": state(version)}, version)
    seen = versions_while_writing(store, monkeypatch, "serialize" if path.endswith("caller's thread") else "save")
    store.save({"state": state(4)}, 4, blocking=path == "sync")
    store.wait()
    assert seen == [[2, 3]]                       # version 1 freed its pages first; 2 and 3 stay complete
    assert store.local.versions("state") == [2, 3, 4]
    loaded, source = store.load_newest("state")
    assert source == "local" and loaded.loaded_version == 4 and loaded.obj["weights"].eq(4).all()
    store.close()


def test_with_one_version_kept_the_old_one_stays_until_the_new_one_is_complete(tmp_path, monkeypatch):
    store = CheckpointManager(tmp_path, keep_last=1)
    store.save({"state": state(1)}, 1)
    seen = versions_while_writing(store, monkeypatch, "save")
    store.save({"state": state(2)}, 2)
    assert seen == [[1]] and store.local.versions("state") == [2]
    store.close()


def test_a_best_version_kept_once_is_not_removed_before_its_successor_is_written(tmp_path, monkeypatch):
    store = CheckpointManager(tmp_path, keep_last=3, keep_per_name={"best": 1})
    store.save({"best": state(1), "state": state(1)}, 1)
    seen = versions_while_writing(store, monkeypatch, "save")
    store.save({"best": state(2), "state": state(2)}, 2)
    assert seen == [[1], [1]] and store.local.versions("best") == [2] and store.local.versions("state") == [1, 2]
    store.close()


SAVER = textwrap.dedent("""
    import sys, torch
    from nblib.store.manager import CheckpointManager
    store = CheckpointManager(sys.argv[1], keep_last=int(sys.argv[2]), clean_temporaries=True)
    found, _ = store.load_newest("state")
    first = found.loaded_version + 1 if found.obj is not None else 1
    for version in range(first, first + 1000):
        store.save({"state": {"weights": torch.full((2_000_000,), float(version))}}, version, blocking=False)
        print(version, flush=True)
""")


@pytest.mark.parametrize("keep_last", [1, 2])
def test_a_sigkill_at_any_moment_of_the_saves_leaves_a_complete_newest_version(tmp_path, keep_last):
    """Real processes saving 8 MB versions back to back, each killed after a different number of saves and
    at a different moment within one; the next process resumes from a complete version that is not older
    than the last save the killed one had finished before the last one it started.
    """
    script = tmp_path / "saver.py"
    script.write_text(SAVER, encoding="utf-8")
    folder = tmp_path / "run"
    for trial in range(3):
        proc = subprocess.Popen([sys.executable, str(script), str(folder), str(keep_last)], env=subprocess_env(),
                                stdout=subprocess.PIPE, text=True)
        started = [int(proc.stdout.readline()) for _ in range(2 + trial)]
        time.sleep(0.003 * trial)                  # somewhere inside the write of the next version
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        store = CheckpointManager(folder, keep_last=keep_last, clean_temporaries=True)
        found, source = store.load_newest("state")
        store.close()
        assert source == "local" and not found.damaged, found.damaged
        # a save returns once the write before it ended: every version but the last printed is complete
        assert found.loaded_version >= started[-2], (found.loaded_version, started)
        assert found.obj["weights"].eq(found.loaded_version).all()
        # a kill after the new version's rename and before the old one's removal leaves one more
        assert len(store.local.versions("state")) <= keep_last + 1
    store = CheckpointManager(folder, keep_last=keep_last, clean_temporaries=True)
    store.save({"state": {"weights": torch.full((8,), float(found.loaded_version + 1))}}, found.loaded_version + 1)
    store.close()
    assert len(store.local.versions("state")) == keep_last     # the next save's prune removes it


@pytest.mark.parametrize("keep_last", [1, 3])
def test_the_budgets_local_peak_is_the_largest_a_save_leaves_on_disk(tmp_path, monkeypatch, keep_last):
    """`retained_bytes(saving=True)`, the training budget's local disk, is the most the checkpoint files take
    at any moment of the saves: measured just after each new file is written, before the prune.
    """
    from nblib.budget.training import BEST_KEPT, retained_bytes

    store = CheckpointManager(tmp_path, keep_last=keep_last, keep_per_name={"best": BEST_KEPT})
    peaks, original = [], store.local.save
    monkeypatch.setattr(store.local, "save", lambda obj, name, version: (
        original(obj, name, version), peaks.append(sum(f.stat().st_size for f in tmp_path.glob("*.pt"))))[0])
    for version in range(1, 7):
        store.save({"best": {"w": torch.zeros(1000)}, "state": {"w": torch.zeros(4000)}}, version)
    store.close()
    sizes = {name: (tmp_path / f"{name}-000006.pt").stat().st_size for name in ("state", "best")}
    assert max(peaks) == retained_bytes(sizes["state"], sizes["best"], keep_last, saving=True)
