"""A state round-trip harness for every resumable object (as torchdata's `run_test_save_load_state`).

`assert_resumes_at_every_step(case)` drives one `Resumable`:

1. the reference: a fresh object's first `steps` outputs, never checkpointed;
2. a second fresh object runs the same steps and is checkpointed after EVERY output (and before
   the first), keeping each state as its checkpoint would persist it (JSON text, a file, a folder);
   its outputs must equal the reference (taking a state must not disturb the stream);
3. only then, for every checkpoint k: a fresh object loads state k and must yield exactly
   reference[k:]. States are resumed after the whole run, so a state that aliases live data
   (mutated by the steps after it was taken) is caught, not just a wrong resume.

Add a resumable object (the training loop, nblib/train/, when it lands) in one of two ways:
- a `Resumable` factory in `CASES` below (taking `tmp_path`; keep torch imports inside it), which
  tests/test_state_roundtrip.py parametrizes over; or
- from its own test file: `assert_resumes_at_every_step(Resumable(...))`, e.g. `make` builds a
  model + optimizer + loader at step 0, `stream` yields each step's loss (or a weights
  fingerprint), `save` writes the loop's checkpoint, `load` restores it into a fresh loop, and
  `same` compares two outputs bit for bit.
"""
from __future__ import annotations

import itertools
import json
import operator
import shutil
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Resumable:
    """How the harness drives one resumable object."""

    name: str
    make: Callable[[], Any]                    # a fresh object at its start
    stream: Callable[[Any], Iterator]          # its outputs, one per step (may be endless)
    save: Callable[[Any, int], Any]            # its checkpoint after `step` outputs (what is persisted)
    load: Callable[[Any, Any], None]           # resume a fresh object from a checkpoint, in place
    steps: int                                 # outputs compared
    same: Callable[[Any, Any], bool] = operator.eq
    close: Callable[[], None] = field(default=lambda: None)   # release what the case opened


def take(iterator: Iterator, n: int) -> list:
    out = list(itertools.islice(iterator, n))
    assert len(out) == n, f"the stream ended after {len(out)} of {n} outputs"
    return out


def assert_resumes_at_every_step(case: Resumable) -> None:
    """Checkpoint `case` after every step, resume each checkpoint in a fresh object, compare."""
    try:
        reference = take(case.stream(case.make()), case.steps)
        live = case.make()
        stream = case.stream(live)
        states, outputs = [case.save(live, 0)], []
        for step in range(1, case.steps + 1):
            outputs.append(next(stream))
            states.append(case.save(live, step))
        _assert_same(case, outputs, reference, "the checkpointed run")
        for step, state in enumerate(states):
            fresh = case.make()
            case.load(fresh, state)
            rest = take(case.stream(fresh), case.steps - step)
            _assert_same(case, rest, reference[step:], f"resumed after step {step}")
    finally:
        case.close()


def _assert_same(case: Resumable, got: list, expected: list, what: str) -> None:
    assert len(got) == len(expected), (case.name, what, len(got), len(expected))
    for i, (a, b) in enumerate(zip(got, expected)):
        assert case.same(a, b), f"{case.name}: {what}: output {i} differs: {a!r} != {b!r}"


def json_round_trip(state: dict) -> str:
    """What a checkpoint file holds: the state as JSON text (loaders take the text)."""
    return json.dumps(state)


def endless(iterable_factory: Callable[[], Iterator]) -> Iterator:
    """Iterate again and again (a sampler moves on to its next epoch by itself)."""
    while True:
        yield from iterable_factory()


def prefetching(iterator: Iterator, ahead: int) -> Iterator:
    """Yield `iterator`'s items while it has run `ahead` items further (a DataLoader's prefetch)."""
    buffered: deque = deque()
    for item in iterator:
        buffered.append(item)
        if len(buffered) > ahead:
            yield buffered.popleft()
    while buffered:
        yield buffered.popleft()


# ------------------------------------------------------------------------------------ the cases

N = 41  # a prime that is no power of two: the Feistel cycle-walks, the last shard and window are partial


def _shuffles():
    from nblib import shuffle as sh

    return {
        "buffer": lambda: sh.ResumableShuffleBuffer(n=N, buffer_size=7, seed=3),
        "buffer-of-1": lambda: sh.ResumableShuffleBuffer(n=N, buffer_size=1, seed=3),
        "buffer-over-n": lambda: sh.ResumableShuffleBuffer(n=N, buffer_size=100, seed=3),
        "global": lambda: sh.GlobalShuffle(n=N, seed=3, epoch=2),
        "shard": lambda: sh.ShardAwareShuffle(n=N, seed=3, epoch=1, shard_size=6, window_shards=3),
    }


def shuffle_case(kind: str) -> Callable[[Path], Resumable]:
    """A shuffle, its state as JSON text after every index."""
    def case(tmp_path: Path) -> Resumable:
        return Resumable(f"shuffle-{kind}", _shuffles()[kind], iter,
                         save=lambda s, _step: json_round_trip(s.state_dict()),
                         load=lambda s, text: s.load_state_dict(text), steps=N)
    return case


def shuffle_file_case(tmp_path: Path) -> Resumable:
    """A buffer shuffle saved with `save_state` to a file per step, loaded with `load_state`."""
    from nblib import shuffle as sh

    def save(s, step):
        return sh.save_state(tmp_path / f"state-{step}.json", s)
    return Resumable("shuffle-buffer-file", _shuffles()["buffer"], iter, save=save,
                     load=lambda s, path: sh.load_state(path, s), steps=N)


def samples_case(tmp_path: Path) -> Resumable:
    """`iter_samples` over a source: the samples (not only indices) continue after a restore."""
    from nblib import shuffle as sh

    source = [f"sample-{i}" for i in range(N)]
    return Resumable("iter-samples-buffer", _shuffles()["buffer"], lambda s: sh.iter_samples(source, s),
                     save=lambda s, _step: json_round_trip(s.state_dict()),
                     load=lambda s, text: s.load_state_dict(text), steps=N)


def sampler_case(kind: str) -> Callable[[Path], Resumable]:
    """torch ShuffleSampler over 2.5 epochs (it moves on to the next epoch by itself), torchdata's protocol."""
    def case(tmp_path: Path) -> Resumable:
        from nblib import shuffle as sh

        return Resumable(f"sampler-{kind}", lambda: sh.ShuffleSampler(_shuffles()[kind]()),
                         lambda s: endless(lambda: iter(s)),
                         save=lambda s, _step: json_round_trip(s.state_dict()),
                         load=lambda s, text: s.load_state_dict(text), steps=2 * N + N // 2)
    return case


def sampler_consumed_case(kind: str) -> Callable[[Path], Resumable]:
    """ShuffleSampler read 5 ahead (a DataLoader's prefetch): `state_dict(consumed=k)` at every k."""
    def case(tmp_path: Path) -> Resumable:
        from nblib import shuffle as sh

        return Resumable(f"sampler-consumed-{kind}", lambda: sh.ShuffleSampler(_shuffles()[kind]()),
                         lambda s: prefetching(iter(s), ahead=5),
                         save=lambda s, step: json_round_trip(s.state_dict(consumed=step)),
                         load=lambda s, text: s.load_state_dict(text), steps=N)
    return case


def dataset_case(consumed: bool) -> Callable[[Path], Resumable]:
    """ShuffledIterableDataset in the main process: its own state, or at `consumed` read 5 ahead."""
    def case(tmp_path: Path) -> Resumable:
        from nblib import shuffle as sh

        source = [(i, 10 * i) for i in range(N)]

        def make():
            return sh.ShuffledIterableDataset(source, _shuffles()["buffer"](), batch_size=4)

        if consumed:
            return Resumable("dataset-consumed", make, lambda d: prefetching(iter(d), ahead=5),
                             save=lambda d, step: json_round_trip(d.state_dict(consumed=step)),
                             load=lambda d, text: d.load_state_dict(text), steps=N)
        return Resumable("dataset", make, iter, save=lambda d, _step: json_round_trip(d.state_dict()),
                         load=lambda d, text: d.load_state_dict(text), steps=N)
    return case


def checkpoint_series_case(tmp_path: Path) -> Resumable:
    """A shuffle's state in a versioned checkpoint series (torch.save + record) after every step.

    Each checkpoint is the folder as it stood then (copied aside); resuming takes `load_latest`
    of that folder, so the series' newest-first walk is what finds the state.
    """
    from nblib.store import CheckpointFolder, load_latest

    live = CheckpointFolder(tmp_path / "series")

    def save(s, step):
        live.save(s.state_dict(), "shuffle", step + 1)
        return shutil.copytree(live.root, tmp_path / f"series-at-{step}")

    def load(s, folder):
        loaded = load_latest([CheckpointFolder(folder)], "shuffle")
        assert not loaded.damaged and loaded.newest_version >= 1
        s.load_state_dict(loaded.obj)
    return Resumable("checkpoint-series", _shuffles()["global"], iter, save=save, load=load, steps=N)


def durable_store_case(tmp_path: Path) -> Resumable:
    """A shuffle's state saved through a DurableStore with a mirror (keep 3), resumed from the mirror alone.

    After every step: `save`, `flush` (the mirror thread copied and verified it), copy the mirror
    folder aside. Resuming opens a new store on an empty local folder and that mirror copy: a
    fresh machine with only Drive left.
    """
    from nblib.store import DurableStore

    store = DurableStore(tmp_path / "local", tmp_path / "mirror", keep_checkpoints=3, backoff_s=0.01)

    def save(s, step):
        store.save(s.state_dict(), "shuffle")
        assert store.flush(timeout=120, strict=True)
        return shutil.copytree(tmp_path / "mirror", tmp_path / f"mirror-at-{step}")

    def load(s, mirror):
        with DurableStore(tmp_path / f"new-local-{mirror.name}", mirror) as fresh:
            s.load_state_dict(fresh.load_latest("shuffle"))
    return Resumable("durable-store", _shuffles()["buffer"], iter, save=save, load=load, steps=N,
                     close=store.close)


CASES: dict[str, Callable[[Path], Resumable]] = {
    **{f"shuffle-{kind}": shuffle_case(kind) for kind in ("buffer", "buffer-of-1", "buffer-over-n", "global", "shard")},
    "shuffle-buffer-file": shuffle_file_case,
    "iter-samples": samples_case,
    **{f"sampler-{kind}": sampler_case(kind) for kind in ("buffer", "global", "shard")},
    **{f"sampler-consumed-{kind}": sampler_consumed_case(kind) for kind in ("buffer", "global", "shard")},
    "dataset": dataset_case(consumed=False),
    "dataset-consumed": dataset_case(consumed=True),
    "checkpoint-series": checkpoint_series_case,
    "durable-store": durable_store_case,
}
TORCH_CASES = {name for name in CASES if name.startswith(("sampler", "dataset", "checkpoint", "durable"))}
