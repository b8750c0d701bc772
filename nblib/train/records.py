"""Training from record shards: a model maps one array field of each record to another, one shard at a time.

`python -m nblib train --records DIR --input-key X --target-key Y` trains it; `python -m nblib predict --run RUN
--records DIR --out PRED` runs its final weights over records (`predict_records`). The inputs and their padding
mask, the targets and losses, the model and the order: "Training from record shards" in docs/your-model.md.
Every record is checked as it is read (`RecordCheck`): one line naming the record.
Trade-off: the first record is read at start to check the fields, the model's output shape, the
loss and the padding before anything is written; a model that mixes rows without a mask is refused
only at the first batch whose records differ in length (a data set of equal lengths never pads).
"""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from nblib.atomic import sha256_json
from nblib.cache.record_reader import RecordShardShuffle
from nblib.errors import ConfigError, InputError, require_choice
from nblib.models.load import seeded
from nblib.trm import autocast

from .config import TrainConfig
from .data import BatchPlan, split
from .task import EVAL_BATCH, Task, contract_identity, freeze_unreached, host, runs_on

LOSSES = ("auto", "ce", "mse")


@dataclass(frozen=True)
class RecordFields:
    """Which record fields a run trains on: the model's input, the target, the loss, classes for --model linear."""

    inputs: str
    target: str
    loss: str = "auto"
    classes: int | None = None

    def __post_init__(self):
        require_choice("loss", self.loss, LOSSES)
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
    """Item i: (input tensor, target tensor, i) of record i; one shard open per process (loader workers too).
    Once the task has read the first record, `check` (a `RecordCheck`) checks every record as it is read.
    """

    def __init__(self, folder: str, inputs: str, target: str):
        from nblib.cache.record_torch import RecordDataset

        self.records = RecordDataset(folder, inputs=inputs, target=target, check="first-touch")
        self.check: RecordCheck | None = None

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int):
        inputs, target = self.records[int(index)]
        target = torch.as_tensor(target)
        if self.check is not None:
            self.check(int(index), inputs, target)
        return inputs, target, int(index)


@dataclass(frozen=True)
class RecordCheck:
    """What every record must hold for the loss to read it as it read the first (`RecordTask`): values that are
    not NaN or inf, a target with its input's rows where the first record's had them (`rows`), and per target
    kind: class labels and top-k indices in [0, classes), top-k rows without a repeated index, probability rows
    of entries >= 0 that sum to 1 (within `PROBABILITY_TOLERANCE` plus two of the dtype's eps).
    """

    inputs: str
    target: str
    kind: str
    rows: bool
    classes: int | None = None

    def __call__(self, index: int, inputs, target) -> None:
        """InputError naming record `index`, what it holds and the rule, at the first rule it breaks."""
        for flag, name, values in (("--input-key", self.inputs, inputs), ("--target-key", self.target, target)):
            values = torch.as_tensor(values)
            if values.is_floating_point() and not bool(torch.isfinite(values).all()):
                self._refuse(index, f"holds {_non_finite(values)} in {flag} {name}", "a loss over it is NaN")
        if self.rows and target.ndim and inputs.ndim and int(target.shape[0]) != int(inputs.shape[0]):
            self._refuse(index, f"has {int(target.shape[0])} target rows (--target-key {self.target} "
                                f"{list(target.shape)}) for {int(inputs.shape[0])} input rows (--input-key "
                                f"{self.inputs} {list(inputs.shape)})", "each input row has one target row")
        if self.kind in ("labels", "top-k") and target.numel():
            low, high = int(target.min()), int(target.max())
            if low < 0 or high >= self.classes:
                self._refuse(index, f"holds class {high if high >= self.classes else low} in --target-key "
                                    f"{self.target}", f"the model gives {self.classes} classes, 0 to "
                                                      f"{self.classes - 1}")
        if self.kind == "top-k" and target.numel():
            rows = target.reshape(-1, target.shape[-1]).sort(-1).values
            repeated = (rows.diff(dim=-1) == 0).any(-1)
            if bool(repeated.any()):
                row = int(repeated.nonzero()[0])
                self._refuse(index, f"repeats an index in top-{target.shape[-1]} row {row} of --target-key "
                                    f"{self.target} ({target.reshape(-1, target.shape[-1])[row].tolist()})",
                             "a top-k row names k distinct classes")
        if self.kind == "probabilities" and target.numel():
            self._check_probabilities(index, target)

    def _check_probabilities(self, index: int, target) -> None:
        rows = target.reshape(-1, target.shape[-1]).double()
        if bool((rows < 0).any()):
            self._refuse(index, f"holds a negative probability ({float(rows.min()):.4g}) in --target-key "
                                f"{self.target}", "soft targets are rows of probabilities >= 0 that sum to 1")
        tolerance = PROBABILITY_TOLERANCE + 2 * torch.finfo(target.dtype).eps
        sums = rows.sum(-1)
        off = (sums - 1).abs() > tolerance
        if bool(off.any()):
            row = int(off.nonzero()[0])
            self._refuse(index, f"has a row of --target-key {self.target} that sums to {float(sums[row]):.6g} "
                                f"(row {row})", f"soft targets are rows of probabilities that sum to 1 "
                                                f"(within {tolerance:.2g})")

    @staticmethod
    def _refuse(index: int, what: str, rule: str) -> None:
        raise InputError(f"record {index} {what}: {rule}; fix that record (or leave it out) and rebuild the "
                         f"records with python -m nblib cache --records")


PROBABILITY_TOLERANCE = 1e-3


def _non_finite(values) -> str:
    """'NaN (3 of 64 values)', or 'inf (...)' when none is NaN."""
    nan = int(torch.isnan(values).sum())
    what, count = ("NaN", nan) if nan else ("inf", int(torch.isinf(values).sum()))
    return f"{what} ({count} of {values.numel()} values)"


def lengths_of(tensors: list) -> torch.Tensor:
    """Each tensor's first dimension (1 for a scalar): the rows of a record that padding does not cover."""
    return torch.tensor([int(t.shape[0]) if t.ndim else 1 for t in tensors])


def collate_inputs(inputs: list) -> torch.Tensor:
    """Input tensors zero-padded along their first dimension; float32 (floats) or int64 (integers)."""
    from nblib.cache.record_torch import pad_collate

    batch = pad_collate(inputs)
    return batch.float() if batch.is_floating_point() else batch.long()


def collate_records(items: list):
    """(inputs, target, target lengths, input lengths, indices) of a batch: zero-padded along the first dimension."""
    target = collate_inputs([item[1] for item in items])
    return (collate_inputs([item[0] for item in items]), target, lengths_of([item[1] for item in items]),
            lengths_of([item[0] for item in items]), torch.tensor([item[2] for item in items]))


class RecordNet(nn.Module):
    """A model of the contract whose forward gives the one output a run trains (by name); a model whose forward
    takes `attention_mask` gets the padding's ([B, T] int64, 1 on real rows).
    """

    def __init__(self, module, output: str | None):
        super().__init__()
        self.model, self.output = module, output
        self.takes_mask = "attention_mask" in inspect.signature(module.forward).parameters

    def forward(self, inputs, lengths=None):
        from nblib.models import named_outputs

        if self.takes_mask and lengths is not None and inputs.ndim >= 2:
            rows = torch.arange(inputs.shape[1], device=inputs.device)
            outs = named_outputs(self.model(inputs, attention_mask=(rows[None, :] < lengths.to(inputs.device)[:, None])
                                            .long()))
        else:
            outs = named_outputs(self.model(inputs))
        if self.output is None:
            self.output = "logits" if "logits" in outs else next(iter(outs))
        if self.output not in outs:
            raise ConfigError(f"the model has no output {self.output!r}; its outputs are {list(outs)}")
        return outs[self.output]


def target_kind(output_shape, target, loss: str) -> str:
    """How the loss reads a batch's target against the model's output ("labels", "top-k", "probabilities" or "values").

    mse: "values". ce: float targets are "probabilities"; integer targets are "labels" when the output is
    [*target, C], "top-k" class indices when the target is [*, k] and the output [*, C] with C >= k.
    """
    if loss == "mse":
        return "values"
    if target.is_floating_point():
        return "probabilities"
    got, want = tuple(output_shape), tuple(target.shape)
    if got[:-1] == want:
        return "labels"
    if len(got) == len(want) and got[:-1] == want[:-1] and want[-1] <= got[-1]:
        return "top-k"
    raise ConfigError(f"the model's output is {list(got)} where integer targets {list(want)} need {[*want, 'C']} "
                      f"(one class label each, ce over C classes) or {[*want[:-1], 'C']} with C >= {want[-1]} "
                      f"(top-{want[-1]} class indices, k-hot); pick another --output, --loss or --model")


def masked_loss(output, target, lengths, loss: str, checked: bool = True):
    """A batch's mean loss over the elements that count (`loss_terms`): the step's loss, and its trace's."""
    per, counted, _ = loss_terms(output, target, lengths, loss, checked)
    return (per * counted).sum() / counted.sum().clamp(min=1)


def loss_terms(output, target, lengths, loss: str, checked: bool = True):
    """(loss per element, the elements that count, the share right per element or None) of a batch
    (docs/your-model.md). Padding (rows past a record's target length) is not counted. checked: class targets
    are checked against the output's classes (a trace's fake tensors hold no values to check).
    """
    output = output.float()
    kind = target_kind(output.shape, target, loss)
    if kind == "values":
        if output.shape != target.shape and output.shape[-1:] == (1,) and output.shape[:-1] == target.shape:
            output = output.squeeze(-1)
        _same_shape(output.shape, target.shape, "mse: the output must have the target's shape")
        per, right = (output - target) ** 2, None
    elif kind == "probabilities":
        _same_shape(output.shape, target.shape, "ce with probability targets: the output has the target's shape")
        per = -(target * F.log_softmax(output, dim=-1)).sum(-1)
        right = (output.argmax(-1) == target.argmax(-1)).float()
    else:
        classes = output.shape[-1]
        if checked and target.numel() and (int(target.min()) < 0 or int(target.max()) >= classes):
            raise ConfigError(f"a target is {int(target.max())} (or {int(target.min())}) but the model gives "
                              f"{classes} classes: give it one output per class (--classes N for the linear model)")
        if kind == "labels":
            per = F.cross_entropy(output.reshape(-1, classes), target.reshape(-1), reduction="none").view(target.shape)
            right = (output.argmax(-1) == target).float()
        else:
            k = target.shape[-1]
            hot = torch.zeros_like(output).scatter_(-1, target, 1.0)
            per = F.binary_cross_entropy_with_logits(output, hot, reduction="none").mean(-1)
            found = torch.zeros_like(output).scatter_(-1, output.topk(k, dim=-1).indices, 1.0)
            right = (found * hot).sum(-1) / k
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


def padding_shift(net, inputs, lengths) -> float:
    """How far a model's output for one record moves when zero rows are appended, with the mask it takes (0.0:
    padding is invisible to it; nan: it cannot take a longer record, so nothing is ever padded for it).
    """
    if inputs.ndim < 2:
        return 0.0
    padded = torch.cat([inputs, inputs.new_zeros((1, max(1, inputs.shape[1]), *inputs.shape[2:]))], dim=1)
    training = net.training
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        net.eval()
        try:
            out = net(inputs, lengths).float()
            again = net(padded, lengths).float()
        except (RuntimeError, ValueError, TypeError, IndexError):
            return math.nan
        finally:
            net.train(training)
    if again.shape != out.shape and again.ndim >= 2 and again.shape[1] == padded.shape[1]:
        again = again[:, :inputs.shape[1]]
    if again.shape != out.shape:
        return math.inf
    return float((again - out).abs().max()) / (1.0 + float(out.abs().max()))


def follows_rows(net, inputs, lengths) -> bool:
    """Whether a model gives one output row per input row: its output's dim 1 grows with a record's rows (a
    pooled output of as many values as the record has rows does not).
    """
    if inputs.ndim < 2:
        return False
    longer = torch.cat([inputs, inputs.new_zeros((1, 1, *inputs.shape[2:]))], dim=1)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        try:
            out = net(longer, lengths + 1)
        except (RuntimeError, ValueError, TypeError, IndexError):
            return False
    return out.ndim >= 2 and int(out.shape[1]) == int(inputs.shape[1]) + 1


class RecordTask(Task):
    """Record shards, one field in and one out, read one shard at a time (see the module docstring)."""

    flag = "--records"

    def __init__(self, folder, config: TrainConfig, fields: RecordFields, *, model: str | None = None,
                 output: str | None = None, weights=None):
        from nblib.cache.record_format import read_record_manifest

        self.folder, self.config, self.fields, self.spec = Path(folder), config, fields, model
        schema = read_record_manifest(folder)["fields"]
        for flag, name in (("--input-key", fields.inputs), ("--target-key", fields.target)):
            if name not in schema:
                raise ConfigError(f"{flag} {name!r} is not a field of the records in {self.folder}; their fields "
                                  f"are {list(schema)}")
        if schema[fields.inputs]["kind"] != "array":
            raise ConfigError(f"--input-key {fields.inputs!r} is a scalar field; the model's input is an "
                              f"array field (one of {[n for n, f in schema.items() if f['kind'] == 'array']})")
        self.dataset, self.collate = IndexedRecords(str(folder), fields.inputs, fields.target), collate_records
        shards = self.dataset.records.shards
        self.train_idx, self.held_idx = split(len(shards), config.holdout)
        per_shard = np.bincount(np.searchsorted(shards.starts, self.train_idx, side="right") - 1,
                                minlength=len(shards.shards))
        self.plan = ShardPlan(self.train_idx, config.batch_size, config.seed,
                              counts=tuple(int(c) for c in per_shard if c))
        inputs, target, lengths, in_lengths, _ = sample = collate_records([self.dataset[int(self.train_idx[0])]])
        self.loss_name = fields.loss if fields.loss != "auto" else ("mse" if target.is_floating_point() else "ce")
        if self.loss_name == "mse" and not target.is_floating_point():
            raise ConfigError(f"--target-key {fields.target} holds integers (class labels): use --loss ce")
        if self.loss_name == "mse" and config.best_metric == "heldout_accuracy":
            raise ConfigError("--best-metric heldout_accuracy needs --loss ce; with mse use heldout_loss")
        self.loaded_as = model_inputs(inputs)              # what load_model builds the --model spec to take
        self.model, self.loaded = self._model(model, output, weights, sample)
        with runs_on(f"--model {model or 'linear'} on --input-key {fields.inputs} {list(inputs.shape)} "
                     f"{inputs.dtype} (one record)"):
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                out = self.model.eval()(inputs, in_lengths)
            freeze_unreached(self.model, inputs, in_lengths)
            self.padding_shift = padding_shift(self.model, inputs, in_lengths)
            per_row = follows_rows(self.model, inputs, in_lengths)
        per = loss_terms(out, target, lengths, self.loss_name)[0]  # the shapes and classes agree, before any save
        self.targets = target_kind(out.shape, target, self.loss_name)
        self.top_k = int(target.shape[-1]) if self.targets == "top-k" else None
        self.chance = self.top_k / int(out.shape[-1]) if self.top_k else None   # top-k: k of C found by guessing
        if self.top_k is not None and bool((target.sort(-1).values.diff(dim=-1) == 0).any()):
            raise ConfigError(f"--target-key {fields.target} {list(target.shape[1:])} reads as top-{self.top_k} class "
                              f"indices against the output {list(out.shape[1:])}, but a row repeats an index: if it "
                              f"holds one label per row, give a model whose output is [..., rows, classes]")
        width = int(out.shape[-1]) if self.loss_name == "ce" else 0
        rows = (per.ndim >= 2 and int(target.shape[1]) == int(inputs.shape[1])      # a loss per row, masked past it
                and per_row)
        self.dataset.check = RecordCheck(fields.inputs, fields.target, self.targets, rows, width or None)
        self.classes = [str(c) for c in range(width)]
        self.model_identity = contract_identity(self.loaded, self.model.output)
        shards.close()

    def identity(self) -> dict:
        manifest = self.dataset.records.shards.manifest
        data = {"fields": manifest["fields"], "shards": [[s["file"], s["sha256"], s["count"]]
                                                           for s in manifest["shards"]]}
        return {"records": sha256_json(data), "inputs": self.fields.inputs, "target": self.fields.target,
                "loss": self.loss_name, "n_train": int(len(self.train_idx)), "model": self.model_identity}

    def traced_record(self) -> dict:
        """The step the VRAM budget traces (nblib.train.traced.record_batch): every record padded to the longest
        shape of each field in the shards, in the dtypes a batch is collated to, and the run's loss.
        """
        shards = self.dataset.records.shards.manifest["shards"]
        sample = self.dataset[int(self.train_idx[0])]

        def longest(name: str, value) -> list:
            dtype = str(collate_inputs([value]).dtype).removeprefix("torch.")
            shapes = [s["max_shapes"][name] for s in shards if name in s.get("max_shapes", {})]
            return [[max(dims) for dims in zip(*shapes)] if shapes else list(value.shape), dtype]

        return {"input": longest(self.fields.inputs, sample[0]), "target": longest(self.fields.target, sample[1]),
                "loss": self.loss_name, "model_inputs": self.loaded_as}

    def forward(self, net, inputs, in_lengths):
        """The model's output on a padded batch; ConfigError when the model sees padding and this batch has some."""
        if self.padding_shift > 1e-4 and int(in_lengths.min()) != int(in_lengths.max()):
            how = "its output changes" if math.isfinite(self.padding_shift) else "its output's shape changes"
            raise ConfigError(f"--model {self.spec} mixes a record's rows and takes no attention_mask: records of "
                              f"{int(in_lengths.min())} and {int(in_lengths.max())} rows share a batch, and {how} "
                              f"when zero rows are appended to a record (relative shift {self.padding_shift:.3g}); "
                              f"give its forward an attention_mask argument ([B, T], 1 on real rows) and mask its "
                              f"pooling with it, or use --batch-size 1")
        return net(inputs, in_lengths)

    def loss(self, net, inputs, target, lengths, in_lengths):
        return masked_loss(self.forward(net, inputs, in_lengths), target, lengths, self.loss_name)

    def held_out_sums(self, model, config: TrainConfig, idx) -> tuple[float, int, float]:
        """(summed loss, elements counted, elements right: nan for mse) of the held-out records `idx` (read in index
        order: shard by shard).
        """
        batch = collate_records([self.dataset[int(i)] for i in idx])
        inputs, target, lengths, in_lengths = (t.to(config.device) for t in batch[:4])
        with autocast(config.precision, config.device):
            out = self.forward(model, inputs, in_lengths)
        per, counted, right = loss_terms(out, target, lengths, self.loss_name)
        right = float((right * counted).sum()) if right is not None else math.nan
        return float((per * counted).sum()), int(counted.sum()), right

    def final_payload(self, model, config: TrainConfig) -> dict:
        """final.pt: the model's weights under state_dict (`--weights` of a later run, `predict --run`), and what
        it is: the spec, the fields, the loss and how it read the targets.
        """
        return {"spec": self.spec or "linear", "model": self.model_identity, "config": self.loaded.config,
                "state_dict": host(model.model.state_dict()), "output": model.output,
                "inputs": self.fields.inputs, "target": self.fields.target, "loss": self.loss_name,
                "targets": self.targets, "top_k": self.top_k, "classes": list(self.classes),
                "model_inputs": self.loaded_as, "train": config.to_dict()}

    def _model(self, spec, output, weights, sample):
        from nblib.models import LoadedModel, Preprocessing, load_model, load_weights, names_trm

        if spec is not None and spec != "linear":
            if names_trm(spec):
                raise ConfigError("the TRM takes images; for record shards pass --model package.module:factory "
                                  "(a module that takes the --input-key tensor), or leave --model out")
            loaded = load_model(spec, weights, seed=self.config.seed, inputs=self.loaded_as)
            return RecordNet(loaded.module, output), loaded
        inputs, target = sample[0], sample[1]
        if not inputs.is_floating_point() or inputs.ndim < 2:
            raise ConfigError(f"the built-in linear model maps float features (the last dim of --input-key "
                              f"{self.fields.inputs}, here {inputs.dtype} {list(inputs.shape[1:])}); pass --model")
        if target.is_floating_point():
            width = int(target.shape[-1]) if target.ndim == inputs.ndim else 1      # else one value per row: squeezed
        elif self.fields.classes is None:
            raise ConfigError(f"--target-key {self.fields.target} holds class labels: pass --classes N (how "
                              f"many classes, or experts for top-k indices) for the built-in linear model, or "
                              f"pass --model")
        else:
            width = self.fields.classes
        module = linear_model(int(inputs.shape[-1]), width, self.config.seed)
        if weights is not None:
            load_weights(module, weights)
        loaded = LoadedModel(module, "linear", "builtin", Preprocessing(),
                             {"in_features": module.in_features, "out_features": module.out_features},
                             None if weights is None else str(weights))
        return RecordNet(module, output), loaded


def model_inputs(inputs) -> str:
    """What a --model spec is loaded to take (nblib.models.load_model's inputs): integer records are token ids
    (a text encoder: transformers' BertModel, ...), others "images", the default (any factory takes its field).
    """
    return "images" if inputs.is_floating_point() else "tokens"


def linear_model(in_features: int, out_features: int, seed: int) -> nn.Linear:
    """The built-in model of `train --records`: a seeded Linear applied per row."""
    return seeded(seed, lambda: nn.Linear(in_features, out_features))


def final_model(payload: dict) -> RecordNet:
    """The trained module of a final.pt (the built-in linear model, or its --model spec) with its weights."""
    from nblib.models import load_model
    from nblib.models.weights import check_state_dict

    if payload["spec"] == "linear":
        module = linear_model(payload["config"]["in_features"], payload["config"]["out_features"], 0)
    else:
        module = load_model(payload["spec"], None, seed=int(payload["train"].get("seed", 0)),
                            inputs=payload.get("model_inputs", "images")).module
    check_state_dict(module, payload["state_dict"], where="final.pt")
    module.load_state_dict(payload["state_dict"], strict=True)
    return RecordNet(module, payload["output"]).eval()


def predictions(net, payload: dict, dataset, batch_size: int, device: str):
    """One dict per record, in index order: its index, the model's output (its padding cut off) and, for ce, the
    prediction: the class (labels), the top k classes (top-k) or the probabilities (probability targets).
    """
    for start in range(0, len(dataset), batch_size):
        items = [dataset[i] for i in range(start, min(len(dataset), start + batch_size))]
        inputs, lengths = collate_inputs(items), lengths_of(items)
        with torch.no_grad():
            out = net(inputs.to(device), lengths).float().cpu()
        per_row = inputs.ndim >= 2 and out.ndim >= 3 and out.shape[1] == inputs.shape[1]
        for k in range(len(items)):
            one = out[k, :int(lengths[k])] if per_row else out[k]
            record = {"index": start + k, "output": one.numpy()}
            if payload.get("targets") == "labels":
                record["prediction"] = one.argmax(-1).numpy()
            elif payload.get("targets") == "top-k":
                record["prediction"] = one.topk(int(payload["top_k"]), dim=-1).indices.numpy()
            elif payload.get("targets") == "probabilities":
                record["prediction"] = one.softmax(-1).numpy()
            yield record


def predict_records(run, records, out, *, batch_size: int = EVAL_BATCH, device: str | None = None,
                    shard_mb: float = 400, overwrite: bool = False):
    """`python -m nblib predict`: run a `train --records` run's final weights over record shards (its --input-key
    field, padded and masked as in training), writing record shards to `out`: one record per input record, in
    index order (see `predictions`). An `out` that is, holds or sits inside `run` or `records` is refused before
    anything is touched (`overwrite` never removes an input). A rerun resumes; returns write_records' summary.
    """
    from nblib.cache.record_torch import RecordDataset
    from nblib.cache.records import write_records

    from .device import require_device
    from .evaluate import check_predict, read_final

    check_predict(run, out, "--records", records)
    payload, device = read_final(run, "--records"), require_device(device)
    dataset = RecordDataset(records, inputs=payload["inputs"], check="first-touch")
    net = final_model(payload).to(device)
    with runs_on(f"--run {run}'s model on --input-key {payload['inputs']} of {records}"):
        return write_records(predictions(net, payload, dataset, batch_size, device), out, shard_mb=shard_mb,
                             overwrite=overwrite)
