"""What a run trains on and with: the images of a cache and their labels, the model, its loss and evaluation.

A task is what the loop (`nblib.train.loop`) needs from the data and the model, whatever they are:
the batch order (`plan`), a picklable `dataset` with its `collate`, the model, the `loss` of a
micro-batch, the held-out `evaluate`, what final.pt holds, and its part of the run's identity.
`ImageTask` (`train --cache`) trains a classifier of the cache's labels:
- the TRM (the default, or `--model trm[:PRESET]`): `Classifier`, the encoder with gradients through
  its last outer cycle and a normalised head, as before (same identity, so old runs still resume);
- any other model (`--model hf:CLASS[:config.json]`, `timm:NAME`, `package.module:factory`, with
  `--weights`): `nblib.models.with_head` puts its preprocessing in front and a seeded Linear head on
  the output `--output` names (default: its own `logits` when it has them, used as they are when
  they have one column per class; else `pooler_output`; else its first output).
The run's identity holds the model's class, config, a hash of its starting weights, its
preprocessing and the head's output, so a resume with another model is refused, naming what
changed (`nblib.train.state.check_model`). `nblib.train.records.RecordTask` is the task over record
shards. Trade-off: a model's parameters no gradient reaches (a pooler beside the output trained on)
are found by one batch-1 forward and backward at start and frozen, so DDP waits for none of them.
"""
from __future__ import annotations

import contextlib
import logging
import shlex
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from nblib.config import named_config as model_config  # the encoder shape a profile or preset trains
from nblib.errors import ConfigError, NblibError
from nblib.models.load import names_trm, seeded
from nblib.trm import autocast

from .config import EVAL_BATCH, TrainConfig
from .data import BatchPlan, LabelledImages, label_digest, labels_for_cache, split
from .model import HEAD_SEED_SALT, Classifier

log = logging.getLogger(__name__)

def contract_identity(loaded, output: str | None, **extra) -> dict:
    """A model's part of a run identity: the contract's identity without the spec, plus the output trained."""
    identity = {k: v for k, v in loaded.identity().items() if k != "spec"}
    return {**identity, "output": output, **extra}


def freeze_unreached(net, *inputs) -> None:
    """Freeze the parameters one forward and backward of `inputs` gives no gradient (no RNG drawn, no stat moved)."""
    with torch.random.fork_rng(devices=[]):
        net.eval()
        out = net(*inputs)
        out.float().sum().backward()
    for param in net.parameters():
        if param.requires_grad and param.grad is None:
            param.requires_grad_(False)
    net.zero_grad(set_to_none=True)
    net.train()


def loop_module(model, n_classes: int, output: str | None = None, image_size: int | None = None,
                config: TrainConfig | None = None):
    """The module `train` runs, built as the run builds it (the VRAM trace, nblib.budget.model_vram, builds it
    here too): for the TRM (a ModelConfig, or a LoadedModel of kind trm) the `Classifier`, gradients through
    its last outer cycle only; for any other LoadedModel `with_head` on `output` (a seeded head) with the
    parameters no gradient reaches frozen by one batch-1 forward and backward.
    """
    from nblib.config import ModelConfig

    config = config or TrainConfig()
    if getattr(model, "kind", None) == "trm":
        model = ModelConfig(**model.config["model"])
    if isinstance(model, ModelConfig):
        return Classifier(model, n_classes, seed=config.seed, dropout=config.dropout)
    from nblib.models.head import with_head

    net = seeded(config.seed ^ HEAD_SEED_SALT, lambda: with_head(model, n_classes, output, image_size=image_size))
    freeze_unreached(net, torch.zeros(1, image_size, image_size, 3, dtype=torch.uint8))
    return net


@contextlib.contextmanager
def runs_on(what: str):
    """A model that fails on its first (batch-1) forward and backward at start: a ConfigError naming `what`."""
    try:
        yield
    except NblibError:
        raise                                               # already says what is wrong (an unknown output)
    except (RuntimeError, ValueError, TypeError, IndexError) as exc:
        raise ConfigError(f"{what}: its forward and backward failed at start ({type(exc).__name__}: "
                          f"{str(exc)[:300]}); give it a model that takes that input, or another --output") from None


def vram_preflight(task, config: TrainConfig, world_size: int = 1):
    """On CUDA, before any work: the traced training budget of the module the loop runs (the TRM's Classifier or
    a --model with its head; `nblib.budget.model_preflight`, the one answer of `nblib.budget.model_vram`) at the
    run's micro-batch and precision; BudgetExceeded with the numbers and the largest micro-batch that fits.
    The trace is of this package's own job (nblib.train.traced, handed to the trace layer): the budget names none.
    A --records run's step is traced on its longest records (`RecordTask.traced_record`). None (nothing checked)
    on CPU, and for the built-in linear model (a spec the trace can rebuild is needed), with one line saying so.
    """
    from nblib.budget.preflight import model_preflight
    from nblib.errors import BudgetExceeded

    if not config.device.startswith("cuda"):
        return None
    if not isinstance(task, ImageTask) and task.loaded.kind == "builtin":
        log.warning("preflight: the VRAM of the built-in linear model is not checked (the trace rebuilds a model "
                    "from its spec: pass --model package.module:factory to have it checked)")
        return None
    record = None if isinstance(task, ImageTask) else task.traced_record()
    micro = config.micro_batch(world_size)
    traced = task.loaded if task.loaded is not None else task.model.encoder.config    # the TRM: its shape
    try:
        vram = model_preflight(traced, micro, config.device, precision=config.precision, train=True,
                               output=getattr(task.model, "output", None), n_classes=len(task.classes),
                               record=record)
    except BudgetExceeded as exc:
        if micro == config.batch_size:
            raise
        split = config.accumulation * world_size
        raise BudgetExceeded(f"{exc} (per forward pass: --batch-size {config.batch_size} is micro-batches of "
                             f"{micro} = batch / (accumulation {config.accumulation} x {world_size} ranks); "
                             f"--batch-size is that micro-batch x {split})") from None
    if vram is not None:        # the same trace: ops torch documents as nondeterministic on CUDA, named now
        from .determinism import check_traced

        check_traced(list(vram.nondeterministic), vram.spec, config.device)
    return vram


def cross_entropy(net, images, labels):
    """An image batch's loss: the cross entropy of the model's logits and the labels (`train_step`'s default)."""
    return F.cross_entropy(net(images), labels)


def host(state: dict) -> dict:
    """A state dict on the host (a no-op on CPU): a T4 run's weights open with a plain torch.load anywhere."""
    return {k: v.cpu() for k, v in state.items()}


class Task:
    """What the image and record tasks share: the held-out evaluation's loop and the command that scores final.pt."""

    flag = ""                           # what predict reads the task's data with: --cache or --records
    chance = None                       # accuracy by guessing: 1 / classes
    val = None                          # an image run's --val (folder, cache, labels): predict scores it instead

    @torch.no_grad()
    def evaluate(self, model, config: TrainConfig, step: int, train_loss: float) -> dict:
        """Held-out loss and accuracy over what `held_out_sums` counts, EVAL_BATCH in index order (no RNG drawn)."""
        model.eval()
        sums = np.zeros(3)              # summed loss, elements counted, elements right
        for start in range(0, len(self.held_idx), EVAL_BATCH):
            sums += self.held_out_sums(model, config, self.held_idx[start:start + EVAL_BATCH])
        model.train()
        loss, count, right = map(float, sums)
        return {"step": step, "train_loss": train_loss, "heldout_loss": loss / max(1, count),
                "heldout_accuracy": right / max(1, count)}

    def next_step(self, final: Path) -> str:
        """The command that scores final.pt: predict over the --val cache (else the task's data), into a folder
        beside the run, never inside what predict reads (nblib.train.evaluate, nblib.train.records.predict_records).
        """
        from nblib.disk import beside

        run, quote = Path(final).parent, shlex.quote
        data = self.val[0] if self.val else self.folder
        return (f"python -m nblib predict --run {quote(str(run))} {self.flag} {quote(str(data))} "
                f"--out {quote(str(beside(run, 'predictions')))}")


class ImageTask(Task):
    """A cache of images and the labels of its texts (or side table), for the TRM or any model with a head."""

    flag = "--cache"

    def __init__(self, cache_dir, config: TrainConfig, *, texts=None, model: str | None = None,
                 output: str | None = None, weights=None, val=None):
        from nblib.cache import ShardedImageCache

        self.folder, self.config, self.spec = Path(cache_dir), config, model
        self.cache = ShardedImageCache(cache_dir)
        self.labels, self.classes = labels_for_cache(self.cache, config.labels, texts)
        self.val = None if val is None else self._val(Path(val))
        if self.val is None:                    # the held-out split carved from the cache
            self.train_idx, self.held_idx = split(len(self.cache), config.holdout)
        else:                                   # every image trains; --val's images are held out
            self.train_idx, self.held_idx = np.arange(len(self.cache)), np.arange(len(self.val[1]))
        self.held_cache, self.held_labels = self.val[1:] if self.val else (self.cache, self.labels)
        self.plan = BatchPlan(self.train_idx, config.batch_size, config.seed)
        self.dataset, self.collate = LabelledImages(str(cache_dir), self.labels), None
        if names_trm(model):
            self.model, self.model_identity, self.loaded = self._trm(model, output, weights)
        else:
            self.model, self.model_identity, self.loaded = self._any(model, output, weights)

    def identity(self) -> dict:
        return {"cache": self.cache.fingerprint, "classes": self.classes,
                "labels": label_digest(self.labels, self.classes), "n_train": int(len(self.train_idx)),
                "model": self.model_identity,
                **({"val": [self.val[1].fingerprint, label_digest(self.val[2], self.classes)]} if self.val else {})}

    loss = staticmethod(cross_entropy)

    def held_out_sums(self, model, config: TrainConfig, idx) -> tuple[float, int, int]:
        """(summed cross entropy, images, images right) of the held-out images `idx` (no augmentation)."""
        images = torch.from_numpy(np.stack([self.held_cache[int(i)] for i in idx])).to(config.device)
        target = torch.from_numpy(self.held_labels[idx]).to(config.device)
        with autocast(config.precision, config.device):
            logits = model(images).float()
        loss = float(F.cross_entropy(logits, target, reduction="sum"))
        return loss, len(idx), int((logits.argmax(1) == target).sum())

    def final_payload(self, model, config: TrainConfig) -> dict:
        """What final.pt holds. The TRM: its save_weights payload plus the head and classes. Another model:
        its own weights under state_dict (what `encode --model SPEC --weights final.pt` loads), the head,
        the spec, the output and the identity.
        """
        if self.loaded is None:
            return {"config": model.encoder.config.__dict__, "state_dict": host(model.encoder.state_dict()),
                    "head": host({k: v for k, v in model.state_dict().items() if not k.startswith("encoder.")}),
                    "classes": list(self.classes), "train": config.to_dict()}
        return {"spec": self.spec, "model": self.model_identity, "config": self.loaded.config,
                "state_dict": host(model.model.state_dict()), "head": host(model.head.state_dict()),
                "output": model.output, "classes": list(self.classes), "train": config.to_dict()}

    def _val(self, folder: Path):
        """(folder, cache, labels as the run's class indices) of a --val cache: the user's own held-out images."""
        from nblib.cache import ShardedImageCache

        from .data import carries_labels, labels_as

        cache = ShardedImageCache(folder)
        if cache.shape != self.cache.shape:
            raise ConfigError(f"--val {folder} holds {'x'.join(map(str, cache.shape))} images, --cache {self.folder} "
                              f"{'x'.join(map(str, self.cache.shape))}: build the --val cache at the training size "
                              f"(python -m nblib cache --images DIR --size {self.cache.image_size} --out NEW)")
        if not carries_labels(cache):
            raise ConfigError(f"--val {folder} holds images without labels: build a labelled cache from a folder "
                              f"of class subfolders (DIR/cat/*.jpg: python -m nblib cache --images DIR --out NEW) or "
                              f"with --labels FILE")
        return folder, cache, labels_as(cache, self.classes, self.config.labels, f"--val {folder}")

    def _trm(self, spec, output, weights):
        if output is not None:
            raise ConfigError(f"--output {output} picks one output of a --model to train a head on; the TRM "
                              f"trains its own head on its sketches: drop --output, or pass --model")
        shape = model_config((spec or "trm").partition(":")[2] or self.config.profile).model
        net = loop_module(shape, len(self.classes), config=self.config)
        identity = dict(shape.__dict__)
        if weights is not None:
            from nblib.models import load_weights, weights_sha256

            load_weights(net.encoder, weights)
            identity["weights_sha256"] = weights_sha256(net.encoder)
        return net, identity, None

    def _any(self, spec, output, weights):
        from nblib.models import load_model

        loaded = load_model(spec, weights, seed=self.config.seed)
        size, pre = self.cache.image_size, loaded.preprocessing
        if pre.layout == "uint8_nhwc" and pre.size is not None and pre.size != (size, size):
            raise ConfigError(f"the cache holds {size}x{size} images, {spec} takes {pre.size[0]}x{pre.size[1]} uint8 "
                              f"images and does not resize; build a cache at that size: python -m nblib cache "
                              f"--images DIR --size {pre.size[0]} --out NEW")
        with runs_on(f"--model {spec} on the cache's [B, {size}, {size}, 3] uint8 images"):
            net = loop_module(loaded, len(self.classes), output, size, self.config)
        return net, contract_identity(loaded, net.output, head="own logits" if net.own_logits else "linear"), loaded
