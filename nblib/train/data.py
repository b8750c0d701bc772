"""What a training step reads: labels that come free with the texts, a held-out split, and the order.

Labels: `kind` (twelve kinds, so chance is 1/12, a bar a broken loop cannot clear by guessing the majority)
or `script` (docs/training.md says why it is not the default). The order: a `GlobalShuffle` of the training
indices per epoch, cut in global batches; rank r of W takes the r-th slice of each, and the state at any
step is the shuffle's ~200 bytes, the same for every world size.
"""
from __future__ import annotations

import collections
import json
import unicodedata
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nblib.errors import ConfigError, InputError, StateError
from nblib.shuffle import GlobalShuffle, load_state_json, state_to_json
from nblib.shuffle.state import state_fields

SPLIT_SALT = 0x7EA1_5EED            # the held-out split does not move when the training seed does


def script_of(text: str) -> str:
    """The Unicode script of most letters of `text` (first word of the character name), or 'none'."""
    counts = collections.Counter(unicodedata.name(ch, "?").split()[0] for ch in text if ch.isalpha())
    return counts.most_common(1)[0][0].lower() if counts else "none"


def scan_labels(texts_path: str | Path, labels: str = "kind", field: str | None = None,
                errors: str = "strict") -> tuple[np.ndarray, list[str], str]:
    """One pass over a JSONL texts file: (label of each record as int64, class names, fingerprint of the texts
    in the file's order: `nblib.cache.texts.scan_texts` over the records' `field`, "text" by default).
    Records are read as a cache reads them (`read_records`: blank lines skipped, `errors` for bad UTF-8).
    """
    from nblib.cache.texts import read_records, scan_texts

    path = Path(texts_path)
    if path.suffix != ".jsonl":
        raise InputError(f"{path} is not a .jsonl file: labels come from its 'kind' field or its texts' "
                         f"script; build the cache from data/sample_texts.jsonl (or pass --texts such a file)")
    names, field = [], field or "text"

    def texts():
        for number, row in read_records(path, field, errors):
            if labels == "kind" and not isinstance(row.get("kind"), str):
                raise InputError(f"{path} line {number} has no 'kind' field; use --labels script")
            names.append(row["kind"] if labels == "kind" else script_of(str(row.get("text", ""))))
            yield row[field]

    sha256 = scan_texts(texts(), sample_size=0).sha256
    classes = sorted(set(names))
    lookup = {name: i for i, name in enumerate(classes)}
    return np.array([lookup[n] for n in names], dtype=np.int64), classes, sha256


def labels_for_cache(cache, labels: str = "kind", texts: str | Path | None = None) -> tuple[np.ndarray, list[str]]:
    """Labels of every image of a cache, from the texts file its manifest records (or `texts`), in one pass that
    also checks the file holds the cache's texts in the cache's order (`check_texts_order`).
    """
    source = cache.manifest["source"]
    if texts is None and source.get("side"):
        return side_table_labels(cache)
    if source.get("kind") == "images" and source.get("side"):
        raise ConfigError(f"--texts labels a cache rendered from texts; {cache.cache_dir} holds images with "
                          f"labels of their own (its side table): drop --texts")
    if source.get("kind") == "images":
        texts_too = " (--texts labels only a cache rendered from texts)" if texts is not None else ""
        raise ConfigError(f"the cache {cache.cache_dir} holds images without labels (a flat folder, a Parquet "
                          f"file or arrays){texts_too}: rebuild it with cache --images DIR where DIR holds one "
                          f"subfolder per class (DIR/cat/*.jpg), or with --labels FILE (a CSV of file,label), "
                          f"or with cache --hf PATH --label-column COLUMN")
    path = texts if texts is not None else source.get("path")
    if path is None:
        raise ConfigError(f"the cache {cache.cache_dir} was built from texts in memory and records no file; "
                          f"pass --texts PATH.jsonl (the texts it was rendered from)")
    if not Path(path).is_file():
        raise InputError(f"the texts file {path} (recorded by the cache {cache.cache_dir}) is missing; "
                         f"pass --texts PATH.jsonl")
    values, classes, sha256 = scan_labels(path, labels, source.get("field"), source.get("errors", "strict"))
    if len(values) != source["n_texts"]:
        raise InputError(f"{path} has {len(values):,} lines but the cache {cache.cache_dir} was rendered from "
                         f"{source['n_texts']:,} texts: they are not its texts; pass the right --texts")
    if source.get("sha256") and not source.get("side"):
        check_texts_order(cache, path, sha256)
    return values[: len(cache)], classes


def check_texts_order(cache, path, sha256: str) -> None:
    """InputError when the texts file whose line k labels image k (`path`, fingerprint `sha256`) is not the cache's
    texts in the cache's order: its fingerprint is not the recorded one. A shuffled copy (the same texts as the
    recorded file, in another order) is named as such.
    """
    from nblib.cache.texts import scan_texts, text_source

    source = cache.manifest["source"]
    if sha256 == source["sha256"]:
        return

    def read(where):
        return text_source(where, source.get("field"), source.get("errors", "strict"))
    n_texts, original = source["n_texts"], source.get("path")
    if (original and Path(original).is_file() and Path(original).resolve() != Path(path).resolve()
            and scan_texts(read(original), 0).sha256 == source["sha256"]
            and _unordered_digest(read(original)) == _unordered_digest(read(path))):
        raise InputError(f"--texts {path} holds the cache's {n_texts:,} texts in another order than {original}, "
                         f"which the cache {cache.cache_dir} was rendered from: line k labels image k, so the labels "
                         f"would go to other images; pass --texts {original} (or drop --texts)")
    raise InputError(f"the texts of {path} (fingerprint {sha256[:12]}, {n_texts:,} texts) are not the ones "
                     f"the cache {cache.cache_dir} was rendered from ({source['sha256'][:12]}): an edited or reordered "
                     f"copy gives images other labels (line k labels image k); pass the texts file the cache was "
                     f"rendered from, or rebuild the cache from this one")


def _unordered_digest(texts) -> int:
    """A fingerprint of the texts that ignores their order: the sum of their sha256s (a multiset hash)."""
    import hashlib

    return sum(int.from_bytes(hashlib.sha256(t.encode("utf-8", "surrogatepass")).digest(), "little")
               for t in texts) % (1 << 256)


def side_table_labels(cache) -> tuple[np.ndarray, list[str]]:
    """Labels of every image of a cache built by `cache --hf ... --label-column` or `cache --wds` (cls)."""
    from nblib.cache.sources import source_labels

    table = source_labels(cache.cache_dir) or {}
    if "labels" not in table:
        raise ConfigError(f"the cache {cache.cache_dir} carries texts, not labels (it was built with "
                          f"--text-column or from txt members); rebuild it with --label-column, or cls members")
    return np.asarray(table["labels"], dtype=np.int64)[: len(cache)], list(table["classes"])


def carries_labels(cache) -> bool:
    """Whether a cache's images have labels: rendered from texts (their kind or script), or built with a label
    table (class subfolders, --labels FILE, --hf --label-column, --wds cls); not a flat folder of images.
    """
    source = cache.manifest["source"]
    side = source.get("side") or {}
    if side:
        return side.get("kind", "labels") == "labels"
    return source.get("kind") != "images"


def labels_as(cache, run_classes: list[str], labels: str = "kind", what: str = "the cache") -> np.ndarray:
    """The labels of every image of `cache` as indices into `run_classes` (a run's class names), matched by name
    (Unicode NFC), so a cache holding a subset of the classes, or listing them in another order, scores right.
    InputError naming the classes the run never saw.
    """
    values, classes = labels_for_cache(cache, labels)
    index = {unicodedata.normalize("NFC", name): i for i, name in enumerate(run_classes)}
    unknown = [classes[i] for i in np.unique(values) if unicodedata.normalize("NFC", classes[i]) not in index]
    if unknown:
        raise InputError(f"{what} has {len(unknown)} class(es) the run was not trained on ({_listed(unknown, 5)}); "
                         f"the run knows {len(run_classes)}: {_listed(run_classes, 10)}; score it on images of "
                         f"those classes only")
    mapping = np.array([index.get(unicodedata.normalize("NFC", name), -1) for name in classes], dtype=np.int64)
    return mapping[values]


def _listed(names: list[str], most: int) -> str:
    return ", ".join(map(repr, names[:most])) + (", ..." if len(names) > most else "")


def label_digest(labels: np.ndarray, classes: list[str]) -> str:
    """sha256 of the class names and every image's label: a resume must train on the same labels.

    A texts file edited since the run started, or a `--texts` that is a shuffled copy, gives other labels
    for the same images; the run's identity holds this digest so such a resume is refused.
    """
    import hashlib

    digest = hashlib.sha256(json.dumps(list(classes)).encode())
    digest.update(np.ascontiguousarray(labels, dtype="<i8").tobytes())
    return digest.hexdigest()


def split(n: int, holdout: float) -> tuple[np.ndarray, np.ndarray]:
    """(train indices, held-out indices), a fixed keyed permutation cut at `holdout`, each sorted."""
    order = GlobalShuffle(n=n, seed=SPLIT_SALT).indices()
    cut = max(1, int(round(n * holdout)))
    if cut >= n:
        raise ConfigError(f"holdout={holdout} of {n} samples leaves nothing to train on")
    return np.sort(order[cut:]), np.sort(order[:cut])


@dataclass(frozen=True)
class BatchPlan:
    """Which cache indices step s reads: global batch s of the epoch's permutation of `train`."""

    train: np.ndarray
    batch_size: int
    seed: int

    @property
    def steps_per_epoch(self) -> int:
        spe = len(self.train) // self.batch_size
        if spe < 1:
            raise ConfigError(f"batch_size={self.batch_size} is larger than the {len(self.train)} training "
                              f"samples; use a smaller batch or a bigger cache")
        return spe

    def shuffle(self, epoch: int = 0):
        """The order of epoch `epoch` over positions of `train` (a plan over shards overrides it)."""
        return GlobalShuffle(n=len(self.train), seed=self.seed, epoch=epoch)

    def shuffle_at(self, step: int):
        """The shuffle positioned where step `step` starts reading (the last partial batch is dropped)."""
        epoch, within = divmod(int(step), self.steps_per_epoch)
        shuffle = self.shuffle(epoch)
        shuffle.position = within * self.batch_size
        return shuffle

    def global_batch(self, step: int) -> np.ndarray:
        """Cache indices of step `step`'s global batch, in order."""
        shuffle = self.shuffle_at(step)
        return self.train[shuffle.indices(shuffle.position, shuffle.position + self.batch_size)]

    def rank_batch(self, step: int, rank: int, world: int) -> np.ndarray:
        """Rank `rank`'s slice of step `step`'s global batch."""
        per = self.batch_size // world
        return self.global_batch(step)[rank * per:(rank + 1) * per]

    def state_bytes(self, step: int) -> bytes:
        """The data order at step `step`: the shuffle's state as JSON bytes."""
        return state_to_json(self.shuffle_at(step).state_dict()).encode()

    def step_of(self, state: bytes) -> int:
        """The step a stored shuffle state resumes at; StateError when it is not this plan's."""
        shuffle = self.shuffle(0)
        loaded = load_state_json(state.decode() if isinstance(state, bytes) else state)
        epoch = state_fields(loaded).get("epoch")
        if isinstance(epoch, int) and epoch != shuffle.epoch:
            shuffle = self.shuffle(epoch)
        shuffle.load_state_dict(loaded)       # refuses another n or seed, or an edited state
        within, rest = divmod(shuffle.position, self.batch_size)
        if rest:
            raise StateError(f"the data-order state sits at position {shuffle.position}, not a multiple of "
                             f"batch_size={self.batch_size}: it belongs to a run with another batch size")
        return shuffle.epoch * self.steps_per_epoch + within


class StepBatches:
    """A batch sampler for torch's DataLoader: this rank's micro-batches for steps [start, stop)."""

    def __init__(self, plan: BatchPlan, start: int, stop: int, rank: int = 0, world: int = 1,
                 accumulation: int = 1):
        self.plan, self.start, self.stop = plan, start, stop
        self.rank, self.world, self.accumulation = rank, world, accumulation

    def __iter__(self):
        for step in range(self.start, self.stop):
            mine = self.plan.rank_batch(step, self.rank, self.world)
            for chunk in np.array_split(mine, self.accumulation):
                yield chunk.tolist()

    def __len__(self) -> int:
        return (self.stop - self.start) * self.accumulation


class LabelledImages:
    """Map-style dataset: item i is (uint8 [H, W, 3] tensor, label, i); picklable for loader workers."""

    def __init__(self, cache_dir: str, labels: np.ndarray):
        from nblib.cache import ShardedImageCache

        self.cache = ShardedImageCache(cache_dir)
        self.labels = labels

    def __len__(self) -> int:
        return len(self.cache)

    def __getitem__(self, index: int):
        import torch

        return torch.from_numpy(self.cache[index]), int(self.labels[index]), int(index)
