"""Training from record shards: a model maps one array field of each record to another, one shard at a time.

`python -m nblib train --records DIR --input-key hidden_states --target-key target_routing --loss ce`
trains the sharding guide's job: a router that predicts each token's routing from its hidden state.
- **Inputs:** one array field (`--input-key`); float arrays reach the model as float32 (autocast
  applies as usual), integer arrays (token ids) as int64. Records of different lengths are
  zero-padded along their first dimension to the batch's longest.
- **Target and loss** (`--target-key`, `--loss`): `ce` takes integer class labels (a scalar per
  record: output [B, C]; or one per token [T]: output [B, T, C]) or rows of class probabilities
  (float [..., C], a soft cross-entropy); `mse` takes float targets of the output's shape (a
  trailing output dimension of 1 is dropped). `auto` (the default): ce for integer targets, mse for
  float ones. Padded tokens (past a record's target length) count in no loss and no accuracy.
- **The model** (`--model`): any spec of the model contract that takes the input tensor
  (`package.module:factory`, `hf:...`), its output picked by `--output` (default: `logits`, else
  its first); without one, a seeded `Linear(input features, target features)` applied per token
  (integer targets need `--classes N` for it).
- **The order:** the held-out split is a keyed choice of records; the training records are read in
  a `RecordShardShuffle` with a window of one shard (the shard order permuted per epoch, records
  permuted within each shard), cut in global batches, so a reader holds one shard at a time (a
  batch that straddles two reads them one after the other). Its state is the shuffle's position:
  a few hundred bytes, resumed exactly at any step, as the image cache's order is.
Trade-off: padding is zeros and the model sees it (a per-token model is unaffected; a model that
mixes tokens should take a length or mask field); the first record is read at start to check the
fields, the model's output shape and the loss before anything is written.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from nblib.atomic import sha256_json
from nblib.cache.record_reader import RecordShardShuffle
from nblib.errors import ConfigError

from .config import TrainConfig
from .data import BatchPlan, split
from .device import autocast
from .task import EVAL_BATCH, contract_identity, freeze_unreached, host, is_trm, runs_on

LOSSES = ("auto", "ce", "mse")


@dataclass(frozen=True)
class RecordFields:
    """Which record fields a run trains on: the model's input, the target, the loss, classes for --model linear."""

    inputs: str
    target: str
    loss: str = "auto"
    classes: int | None = None

    def __post_init__(self):
        if self.loss not in LOSSES:
            raise ConfigError(f"loss={self.loss!r} is unknown; choose one of {LOSSES}")
        if self.classes is not None and (isinstance(self.classes, bool) or not isinstance(self.classes, int)
                                         or self.classes < 2):
            raise ConfigError(f"classes={self.classes!r} must be an integer >= 2")


@dataclass(frozen=True)
class ShardPlan(BatchPlan):
    """A BatchPlan whose epoch order reads the training records one shard at a time (`counts` per shard)."""

    counts: tuple[int, ...] = ()

    def shuffle(self, epoch: int = 0):
        return RecordShardShuffle(counts=list(self.counts), seed=self.seed, epoch=epoch, window_shards=1)


class IndexedRecords(torch.utils.data.Dataset):
    """Item i: (input tensor, target tensor, i) of record i; one shard open per process (loader workers too)."""

    def __init__(self, folder: str, inputs: str, target: str):
        from nblib.cache.record_torch import RecordDataset

        self.records = RecordDataset(folder, inputs=inputs, target=target, check="first-touch")

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int):
        inputs, target = self.records[int(index)]
        return inputs, torch.as_tensor(target), int(index)


def collate_records(items: list):
    """(inputs, target, target lengths, indices) of a batch: zero-padded along the first dimension."""
    from nblib.cache.record_torch import pad_collate

    inputs = pad_collate([item[0] for item in items])
    target = pad_collate([item[1] for item in items])
    inputs = inputs.float() if inputs.is_floating_point() else inputs.long()
    target = target.float() if target.is_floating_point() else target.long()
    lengths = torch.tensor([int(item[1].shape[0]) if item[1].ndim else 1 for item in items])
    return inputs, target, lengths, torch.tensor([item[2] for item in items])


class RecordNet(nn.Module):
    """A model of the contract whose forward gives the one output a run trains (by name)."""

    def __init__(self, module, output: str | None):
        super().__init__()
        self.model, self.output = module, output

    def forward(self, inputs):
        from nblib.models import named_outputs

        outs = named_outputs(self.model(inputs))
        if self.output is None:
            self.output = "logits" if "logits" in outs else next(iter(outs))
        if self.output not in outs:
            raise ConfigError(f"the model has no output {self.output!r}; its outputs are {list(outs)}")
        return outs[self.output]


def loss_terms(output, target, lengths, loss: str):
    """(loss per element, the elements that count, which are right or None) of a batch; see the module doc."""
    output = output.float()
    integer = not target.is_floating_point()
    if loss == "mse":
        if output.shape != target.shape and output.shape[-1:] == (1,) and output.shape[:-1] == target.shape:
            output = output.squeeze(-1)
        _same_shape(output.shape, target.shape, "mse: the output must have the target's shape")
        per, right = (output - target) ** 2, None
    elif integer:
        _same_shape(output.shape[:-1], target.shape, "ce with integer targets: the output is [*target, classes]")
        classes = output.shape[-1]
        if target.numel() and (int(target.min()) < 0 or int(target.max()) >= classes):
            raise ConfigError(f"a target is {int(target.max())} (or {int(target.min())}) but the model gives "
                              f"{classes} classes: give it one output per class (--classes N for the linear model)")
        per = F.cross_entropy(output.reshape(-1, classes), target.reshape(-1), reduction="none").view(target.shape)
        right = output.argmax(-1) == target
    else:
        _same_shape(output.shape, target.shape, "ce with probability targets: the output has the target's shape")
        per = -(target * F.log_softmax(output, dim=-1)).sum(-1)
        right = output.argmax(-1) == target.argmax(-1)
    return per, _counted(per, lengths), right


def _counted(per, lengths):
    """The elements of a per-element loss that are not padding: dim 1 is the record's first dim when it exists."""
    if per.ndim < 2:
        return torch.ones_like(per, dtype=torch.bool)
    valid = torch.arange(per.shape[1], device=per.device)[None, :] < lengths[:, None].to(per.device)
    return valid.view(*valid.shape, *([1] * (per.ndim - 2))).expand_as(per)


def _same_shape(got, want, rule: str) -> None:
    if tuple(got) != tuple(want):
        raise ConfigError(f"the model's output is {list(got)} where the target needs {list(want)} ({rule}); "
                          f"pick another --output, --loss or --model")


class RecordTask:
    """Record shards, one field in and one out, read one shard at a time (see the module docstring)."""

    flag = "--records"

    def __init__(self, folder, config: TrainConfig, fields: RecordFields, *, model: str | None = None,
                 output: str | None = None, weights=None):
        from nblib.cache.record_format import read_record_manifest

        self.folder, self.config, self.fields, self.spec = Path(folder), config, fields, model
        self._check_fields(read_record_manifest(folder)["fields"])
        self.dataset, self.collate = IndexedRecords(str(folder), fields.inputs, fields.target), collate_records
        shards = self.dataset.records.shards
        self.train_idx, self.held_idx = split(len(shards), config.holdout)
        per_shard = np.bincount(np.searchsorted(shards.starts, self.train_idx, side="right") - 1,
                                minlength=len(shards.shards))
        self.plan = ShardPlan(self.train_idx, config.batch_size, config.seed,
                              counts=tuple(int(c) for c in per_shard if c))
        inputs, target, lengths, _ = sample = collate_records([self.dataset[int(self.train_idx[0])]])
        self.loss_name = fields.loss if fields.loss != "auto" else ("mse" if target.is_floating_point() else "ce")
        if self.loss_name == "mse" and not target.is_floating_point():
            raise ConfigError(f"--target-key {fields.target} holds integers (class labels): use --loss ce")
        if self.loss_name == "mse" and config.best_metric == "heldout_accuracy":
            raise ConfigError("--best-metric heldout_accuracy needs --loss ce; with mse use heldout_loss")
        self.model, self.loaded = self._model(model, output, weights, sample)
        with runs_on(f"--model {model or 'linear'} on --input-key {fields.inputs} {list(inputs.shape)} "
                     f"{inputs.dtype} (one record)"):
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                out = self.model.eval()(inputs)
            freeze_unreached(self.model, inputs)
        loss_terms(out, target, lengths, self.loss_name)            # the shapes and classes agree, before any save
        width = int(out.shape[-1]) if self.loss_name == "ce" else 0
        self.classes = [str(c) for c in range(width)]
        self.model_identity = contract_identity(self.loaded, self.model.output)
        shards.close()

    def identity(self) -> dict:
        manifest = self.dataset.records.shards.manifest
        data = {"fields": manifest["fields"], "shards": [[s["file"], s["sha256"], s["count"]]
                                                           for s in manifest["shards"]]}
        return {"records": sha256_json(data), "inputs": self.fields.inputs, "target": self.fields.target,
                "loss": self.loss_name, "n_train": int(len(self.train_idx)), "model": self.model_identity}

    def loss(self, net, inputs, target, lengths):
        per, counted, _ = loss_terms(net(inputs), target, lengths, self.loss_name)
        return (per * counted).sum() / counted.sum().clamp(min=1)

    @torch.no_grad()
    def evaluate(self, model, config: TrainConfig, step: int, train_loss: float) -> dict:
        """Held-out loss (and accuracy for ce) over the counted elements, read in index order: shard by shard."""
        model.eval()
        total, count, correct = 0.0, 0, 0
        for start in range(0, len(self.held_idx), EVAL_BATCH):
            batch = collate_records([self.dataset[int(i)] for i in self.held_idx[start:start + EVAL_BATCH]])
            inputs, target, lengths = (t.to(config.device) for t in batch[:3])
            with autocast(config.device, config.precision):
                out = model(inputs)
            per, counted, right = loss_terms(out, target, lengths, self.loss_name)
            total += float((per * counted).sum())
            count += int(counted.sum())
            correct += int((right & counted).sum()) if right is not None else 0
        model.train()
        accuracy = correct / max(1, count) if self.loss_name == "ce" else math.nan
        return {"step": step, "train_loss": train_loss, "heldout_loss": total / max(1, count),
                "heldout_accuracy": accuracy}

    def final_payload(self, model, config: TrainConfig) -> dict:
        """final.pt: the model's weights under state_dict (`--weights` of a later run or encode), and what it is."""
        return {"spec": self.spec or "linear", "model": self.model_identity, "config": self.loaded.config,
                "state_dict": host(model.model.state_dict()), "output": model.output,
                "inputs": self.fields.inputs, "target": self.fields.target, "loss": self.loss_name,
                "classes": list(self.classes), "train": config.to_dict()}

    def _check_fields(self, schema: dict) -> None:
        for flag, name in (("--input-key", self.fields.inputs), ("--target-key", self.fields.target)):
            if name not in schema:
                raise ConfigError(f"{flag} {name!r} is not a field of the records in {self.folder}; their fields "
                                  f"are {list(schema)}")
        if schema[self.fields.inputs]["kind"] != "array":
            raise ConfigError(f"--input-key {self.fields.inputs!r} is a scalar field; the model's input is an "
                              f"array field (one of {[n for n, f in schema.items() if f['kind'] == 'array']})")

    def _model(self, spec, output, weights, sample):
        from nblib.models import LoadedModel, Preprocessing, load_model, load_weights

        if spec is not None and spec != "linear":
            if is_trm(spec):
                raise ConfigError("the TRM takes images; for record shards pass --model package.module:factory "
                                  "(a module that takes the --input-key tensor), or leave --model out")
            loaded = load_model(spec, weights, seed=self.config.seed)
            return RecordNet(loaded.module, output), loaded
        inputs, target = sample[0], sample[1]
        if not inputs.is_floating_point() or inputs.ndim < 2:
            raise ConfigError(f"the built-in linear model maps float features (the last dim of --input-key "
                              f"{self.fields.inputs}, here {inputs.dtype} {list(inputs.shape[1:])}); pass --model")
        width = self._linear_width(target, inputs.ndim)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.config.seed)
            module = nn.Linear(int(inputs.shape[-1]), width)
        if weights is not None:
            load_weights(module, weights)
        loaded = LoadedModel(module, "linear", "builtin", Preprocessing(),
                             {"in_features": module.in_features, "out_features": width},
                             None if weights is None else str(weights))
        return RecordNet(module, output), loaded

    def _linear_width(self, target, inputs_ndim: int) -> int:
        if not target.is_floating_point():
            if self.fields.classes is None:
                raise ConfigError(f"--target-key {self.fields.target} holds class labels: pass --classes N (how "
                                  f"many classes) for the built-in linear model, or pass --model")
            return self.fields.classes
        return int(target.shape[-1]) if target.ndim == inputs_ndim else 1      # else one value per row: squeezed
