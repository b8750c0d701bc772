"""Scoring a run: `python -m nblib predict --run RUN --cache TEST_CACHE --out DIR` (`predict_images`).

A run trained by `train --cache` is rebuilt as the loop builds it (`nblib.train.task.loop_module`) with
final.pt's weights, in eval mode, and run over every image of an image cache in index order; predictions.csv's
columns, the accuracy, the confusion matrix and how classes are matched: "Scoring a run" in docs/training.md.
The CSV is written atomically; a rerun replaces it (and removes an earlier run's confusion.png until redrawn).
The refusals that need no model (`check_predict`) come before torch is imported.
"""
from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nblib.atomic import atomic_write_bytes
from nblib.config import ModelConfig
from nblib.errors import ConfigError, InputError

from .config import EVAL_BATCH

PREDICTIONS = "predictions.csv"
CONFUSION = "confusion.png"
TOP_K = 5
TABLE_CLASSES = 20          # the most classes the printed confusion matrix shows (the PNG and CSV have all)


def check_predict(run, out, data_flag: str, data) -> None:
    """The refusals of `predict` that need no model, before torch is imported: an --out that is, holds or sits
    inside --run or the data (`data_flag` --cache or --records), no final.pt, a data folder of the other kind.
    """
    from nblib.cache.format import read_cache_manifest
    from nblib.cache.record_format import read_record_manifest
    from nblib.disk import refuse_overlap

    refuse_overlap("predict", out, {"--run": run, data_flag: data}, suffix="predictions")
    final = Path(run) / "final.pt"
    if not final.is_file():
        raise InputError(f"{final} does not exist: --run names the --out of a finished train run (rerun its "
                         f"train command to finish it)")
    (read_cache_manifest if data_flag == "--cache" else read_record_manifest)(data)
    if Path(out).exists() and not Path(out).is_dir():
        raise InputError(f"--out {out} is a file; pass a folder for the predictions")


def read_final(run, data_flag: str) -> dict:
    """The final.pt of a finished run, for predictions over `data_flag` (--cache: an image run; --records: a
    `train --records` run); InputError naming the right flag when it is the other kind of run.
    """
    import pickle
    import warnings

    import torch

    path = Path(run) / "final.pt"
    try:
        with warnings.catch_warnings():     # torch's own about a file it then refuses: the refusal says it all
            warnings.simplefilter("ignore")
            payload = torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, pickle.UnpicklingError, EOFError, ValueError) as exc:
        why = " ".join(str(exc).split())[:160]
        raise InputError(f"{path} cannot be read as a torch file, so it is damaged or no run's final.pt "
                         f"({type(exc).__name__}: {why}); pass --run the --out of a finished train run") from None
    if not isinstance(payload, dict) or "state_dict" not in payload or "classes" not in payload:
        raise InputError(f"{path} is not the final.pt of a train run (no state_dict or classes): pass --run the "
                         f"--out of a finished python -m nblib train")
    records_run = "inputs" in payload
    if data_flag == "--records" and not records_run:
        raise InputError(f"{path} holds the weights of an image run (train --cache), not of train --records: "
                         f"score it with python -m nblib predict --run {run} --cache TEST_CACHE --out DIR")
    if data_flag == "--cache" and records_run:
        raise InputError(f"{path} holds a train --records run (input {payload['inputs']!r}): predict over record "
                         f"shards with python -m nblib predict --run {run} --records DIR --out DIR")
    return payload


def image_model(payload: dict, image_size: int):
    """The module an image run trained, built as the loop builds it (`loop_module`), with final.pt's weights,
    in eval mode.
    """
    from nblib.models.weights import check_state_dict

    from .task import loop_module, runs_on

    n_classes = len(payload["classes"])
    if "spec" not in payload:                       # the TRM: its encoder's weights, the head beside them
        net = loop_module(ModelConfig(**payload["config"]), n_classes)
        state = {**{f"encoder.{k}": v for k, v in payload["state_dict"].items()}, **payload["head"]}
    else:
        from nblib.models import load_model

        loaded = load_model(payload["spec"], None, seed=int(payload["train"].get("seed", 0)))
        with runs_on(f"--model {payload['spec']} on [B, {image_size}, {image_size}, 3] uint8 images"):
            net = loop_module(loaded, n_classes, payload["output"], image_size)
        state = {**{f"model.{k}": v for k, v in payload["state_dict"].items()},
                 **{f"head.{k}": v for k, v in payload["head"].items()}}
    check_state_dict(net, state, where="final.pt")
    net.load_state_dict(state, strict=True)
    return net.eval()


def class_scores(net, cache, *, batch_size: int, device: str, precision: str) -> np.ndarray:
    """Softmax probabilities [images, classes] (float32) of every image of `cache`, in index order."""
    import torch

    from nblib.trm import autocast

    if precision == "fp16" and not device.startswith("cuda"):
        precision = "fp32"                          # fp16 autocast is a CUDA thing; bf16 and fp32 run anywhere
    scores = None
    with torch.no_grad():
        for start in range(0, len(cache), batch_size):
            stop = min(len(cache), start + batch_size)
            images = torch.from_numpy(cache.get_batch(start, stop)).to(device)
            with autocast(precision, device):
                logits = net(images).float()
            if scores is None:
                scores = np.empty((len(cache), logits.shape[1]), dtype=np.float32)
            scores[start:stop] = logits.softmax(-1).cpu().numpy()
    return scores if scores is not None else np.empty((0, 0), dtype=np.float32)


@dataclass
class Evaluation:
    """A run's predictions over an image cache; with `truth` (its labels as the run's class indices) the scores."""

    run: Path
    cache: Path
    out: Path
    classes: list[str]                  # the run's class names: column j of `scores`
    scores: np.ndarray                  # [images, classes] softmax probabilities
    keys: list[str] | None = None       # each image's file name (cache --images), when the cache records them
    truth: np.ndarray | None = None     # each image's class (index into `classes`), when the cache has labels
    top_k: int = TOP_K

    @property
    def ranked(self) -> np.ndarray:
        """Class indices [images, top_k], the most likely first (ties: the lower index first)."""
        return np.argsort(-self.scores, axis=1, kind="stable")[:, :self.top_k]

    @property
    def predicted(self) -> np.ndarray:
        return self.ranked[:, 0] if len(self.scores) else np.empty(0, dtype=np.int64)

    @property
    def correct(self) -> int:
        return int((self.predicted == self.truth).sum()) if self.truth is not None else 0

    @property
    def title(self) -> str:
        return f"{self.run.name} on {self.cache.name}: accuracy {self.accuracy:.1%}"

    @property
    def accuracy(self) -> float:
        return self.correct / len(self.truth) if self.truth is not None and len(self.truth) else math.nan

    def confusion(self) -> np.ndarray:
        """Counts [true class, predicted class] over the run's classes."""
        matrix = np.zeros((len(self.classes), len(self.classes)), dtype=np.int64)
        np.add.at(matrix, (self.truth, self.predicted), 1)
        return matrix

    def per_class(self) -> list[tuple[str, int, int]]:
        """(class, images right, images) of each class the cache holds, in the run's order."""
        matrix = self.confusion()
        return [(name, int(matrix[i, i]), int(matrix[i].sum())) for i, name in enumerate(self.classes)
                if matrix[i].sum()]

    def csv_text(self) -> str:
        """predictions.csv: its columns are in docs/training.md ("Scoring a run")."""
        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        labelled = self.truth is not None
        writer.writerow(["index", "key", *(["label"] if labelled else []), "prediction", "score",
                         *[column for j in range(2, self.top_k + 1) for column in (f"top{j}", f"top{j}_score")]])
        for i, ranked in enumerate(self.ranked):
            ranks = [value for j in ranked for value in (self.classes[j], f"{self.scores[i, j]:.6g}")]
            writer.writerow([i, self.keys[i] if self.keys else "",
                             *([self.classes[self.truth[i]]] if labelled else []), *ranks])
        return buffer.getvalue()

    def __str__(self) -> str:
        lines = [f"predicted {len(self.scores):,} images of {self.cache} with {self.run / 'final.pt'} "
                 f"({len(self.classes)} classes): {self.out / PREDICTIONS}"]
        if self.truth is None:
            lines.append(f"{self.cache} has no labels: no accuracy (build it from class subfolders, or with "
                         f"--labels FILE, to score)")
            return "\n".join(lines)
        lines.append(f"accuracy {self.accuracy:.1%} ({self.correct:,} of {len(self.truth):,} images; chance "
                     f"{1 / len(self.classes):.1%})")
        lines.append("per class: " + ", ".join(f"{name} {right / total:.1%} ({right:,} of {total:,})"
                                               for name, right, total in self.per_class()))
        lines.extend(self._confusion_lines())
        return "\n".join(lines)

    def _confusion_lines(self) -> list[str]:
        matrix = self.confusion()
        shown = [i for i in range(len(self.classes)) if matrix[i].sum() or matrix[:, i].sum()]
        if len(shown) > TABLE_CLASSES:
            return [f"confusion: {len(shown)} classes, too many to print: see {CONFUSION}"]
        names = [self.classes[i] for i in shown]
        name_width = max(len(n) for n in names)
        width = max(3, len(str(len(shown))), len(str(int(matrix.max(initial=0)))))
        lines = ["confusion (rows: true class; columns: predicted, numbered as the rows):",
                 " " * (4 + name_width) + "".join(f" {k:>{width}}" for k in range(1, len(shown) + 1))]
        lines.extend(f"{k:>3} {names[k - 1]:<{name_width}}" + "".join(f" {int(matrix[i, j]):>{width}}" for j in shown)
                     for k, i in enumerate(shown, start=1))
        return lines


def predict_images(run, cache, out, *, top_k: int = TOP_K, batch_size: int = EVAL_BATCH,
                   device: str | None = None) -> Evaluation:
    """`python -m nblib predict --run RUN --cache CACHE --out DIR`: score a `train --cache` run (RUN/final.pt) on
    an image cache; writes DIR/predictions.csv (docs/training.md, "Scoring a run"). Returns the Evaluation: printing it
    gives the accuracy, per class, and the confusion matrix; `nblib.plots.confusion_matrix(e.confusion(),
    e.classes, save_to=...)` draws it.
    """
    check_predict(run, out, "--cache", cache)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ConfigError(f"top_k={top_k!r} must be an integer >= 1 (--top-k K)")
    from nblib.cache import ShardedImageCache
    from nblib.cache.images import source_keys

    from .data import carries_labels, labels_as
    from .device import require_device

    payload, device = read_final(run, "--cache"), require_device(device)
    images, classes = ShardedImageCache(cache), list(payload["classes"])
    train = payload.get("train", {})
    truth = labels_as(images, classes, train.get("labels", "kind"), f"--cache {cache}") \
        if carries_labels(images) else None
    _check_size(payload, images, cache)
    net = image_model(payload, images.image_size).to(device)
    scores = class_scores(net, images, batch_size=batch_size, device=device, precision=train.get("precision", "fp32"))
    evaluation = Evaluation(Path(run), Path(cache), Path(out), classes, scores, source_keys(cache), truth,
                            min(top_k, len(classes)))
    Path(out).mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(Path(out) / PREDICTIONS, evaluation.csv_text().encode("utf-8", "backslashreplace"))
    (Path(out) / CONFUSION).unlink(missing_ok=True)         # an earlier run's matrix is not this one's
    return evaluation


def _check_size(payload: dict, images, cache) -> None:
    """The TRM takes images of its own size and does not resize: another size is refused in one line."""
    size = payload["config"].get("image_size") if "spec" not in payload else None
    if size is not None and images.image_size != size:
        raise ConfigError(f"--cache {cache} holds {images.image_size}x{images.image_size} images, the run's TRM "
                          f"takes {size}x{size} and does not resize; build the test cache at that size: python -m "
                          f"nblib cache --images DIR --size {size} --out NEW")
