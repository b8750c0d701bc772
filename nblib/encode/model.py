"""The model an encode run runs: any module through the contract (`nblib.models`), one inference wrapper.

`encode_model(...)` loads the model a spec names (the TRM by default, built from the run's config
and seed as before), picks the outputs to store (the TRM's `run.outputs`; for another model the
`outputs` asked for, default all it returns) and their per-sample shapes from one CPU forward.
`EncodeModel.__call__` is the one place a batch runs: inference mode, autocast for the run's
precision, PyTorch's SDPA pick, the model's preprocessing, its named outputs. The TRM goes
through it too, byte for byte its old path. Trade-off: the TRM keeps its old weights
fingerprint (so manifests written before the contract still resume); any other model is
fingerprinted by its identity (class, config, weights sha256, preprocessing), so a refusal names
what changed.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nblib.config import PipelineConfig
from nblib.errors import ConfigError

__all__ = ["EncodeModel", "encode_model"]


@dataclass(frozen=True)
class EncodeModel:
    """A loaded model (`nblib.models.LoadedModel`), the outputs a run stores, their shapes and precision."""

    loaded: object
    outputs: tuple[str, ...]
    shapes: dict[str, tuple[int, ...]]
    precision: str = "auto"
    inputs: str = "images"             # or "tokens:LENGTH": encode --records (nblib.encode.token_records)

    @property
    def is_trm(self) -> bool:
        return self.loaded.kind == "trm"

    @property
    def module(self):
        return self.loaded.module

    def __call__(self, batch) -> dict:
        """uint8 [B, H, W, 3] (or int64 [B, 2, LENGTH] token ids and mask) on the run's device -> {output: tensor},
        under inference mode and autocast.
        """
        import torch

        from nblib.sdpa import sdpa_context
        from nblib.trm import autocast

        with torch.inference_mode(), autocast(self.precision, batch.device), sdpa_context(None):
            named = self.loaded(batch) if self.inputs == "images" else _named_on_tokens(self.loaded, batch)
        return {name: named[name] for name in self.outputs}

    def fingerprints(self) -> dict:
        """The run fingerprints that say which model made the outputs (see the module docstring)."""
        from nblib.models.weights import weights_sha256

        if self.is_trm:
            return {"weights": weights_sha256(self.module, typed=False)}   # the TRM's, as manifests record it
        return {"model": self.loaded.identity()}

    def settings(self, settings: dict) -> dict:
        """The run's settings with the model's part: the TRM's config shape, or another model's class and outputs."""
        if self.is_trm:      # the module's shape: the config's, or a trm:PRESET's
            return {**settings, "model": dataclasses.asdict(self.module.config)}
        identity = self.loaded.identity()
        return {**settings, "model": {"class": identity["class"]}, "outputs": list(self.outputs),
                **({} if self.inputs == "images" else {"inputs": self.inputs})}

    def bytes_per_sample(self, out_dtype: str) -> int:
        """Bytes one sample's stored outputs take, in `out_dtype`."""
        itemsize = np.dtype(out_dtype).itemsize
        return sum(math.prod(self.shapes[name]) * itemsize for name in self.outputs)

    def check_image_size(self, image_size: int, config: PipelineConfig) -> None:
        """ConfigError when the model cannot take the cache's images (a model that resizes takes any size)."""
        if self.inputs != "images":
            return
        if self.is_trm:
            want = self.module.config.image_size
            if image_size != want:
                raise ConfigError(
                    f"the cache holds {image_size}x{image_size} images, the {config.name} model expects "
                    f"{want}x{want}; pick a profile with image_size={image_size} or re-render the cache at "
                    f"image_size={want}")
            return
        pre = self.loaded.preprocessing
        if pre.layout == "uint8_nhwc" and pre.size is not None and pre.size != (image_size, image_size):
            raise ConfigError(
                f"the cache holds {image_size}x{image_size} images, {self.loaded.spec} takes "
                f"{pre.size[0]}x{pre.size[1]} uint8 images and does not resize; re-render the cache at "
                f"that size, or declare a preprocessing that resizes")


def encode_model(config: PipelineConfig, model=None, weights: str | Path | None = None, *,
                 outputs: tuple[str, ...] | None = None, precision: str = "auto",
                 image_size: int | None = None, inputs: str = "images") -> EncodeModel:
    """The model a run encodes with: `model` a spec string, a `LoadedModel` or an nn.Module (None: the TRM).

    outputs: the names to store (the TRM: the config's run.outputs; another model: all by default);
    ConfigError naming the model's outputs for an unknown one. inputs: "images", or "tokens:LENGTH" for a text
    encoder on token ids (encode --records).
    """
    from nblib.models import LoadedModel, load_model
    from nblib.models.load import module_model, names_trm

    tokens = inputs != "images"
    if tokens and names_trm(model):
        raise ConfigError("the TRM takes images; to encode records of token ids pass --model, a text encoder "
                          "whose forward takes input_ids and attention_mask (hf:BertModel:config.json)")
    if isinstance(model, LoadedModel):
        loaded = model
        if weights is not None:
            raise ConfigError("weights= goes with a model spec; load them into the LoadedModel instead")
    elif model is None or isinstance(model, str):
        loaded = load_model(model, weights, config=config, seed=config.run.seed,
                            inputs="tokens" if tokens else "images")
    else:
        cls = type(model)
        loaded = module_model(model.eval(), f"{cls.__module__}.{cls.__qualname__}", "module")
        if weights is not None:
            raise ConfigError("weights= goes with a model spec; load them into the module instead")
    if loaded.kind == "trm":
        loaded.module.set_inference(precision=precision)
        from nblib import budget

        shapes = budget.output_shapes(loaded.module.config)
        return EncodeModel(loaded, tuple(config.run.outputs), {o: tuple(shapes[o]) for o in config.run.outputs},
                           precision)
    if tokens:
        import torch

        with torch.no_grad():
            named = _named_on_tokens(loaded, torch.ones((2, 2, int(inputs.partition(":")[2])), dtype=torch.int64))
        shapes = {name: tuple(t.shape[1:]) for name, t in named.items()}
    else:
        shapes = loaded.output_shapes(image_size or config.model.image_size)
    chosen = tuple(outputs) if outputs else tuple(shapes)
    unknown = [o for o in chosen if o not in shapes]
    if unknown or len(set(chosen)) != len(chosen):
        raise ConfigError(f"outputs {list(chosen)}: {loaded.spec} returns {list(shapes)}; pick distinct names "
                          f"among them (--outputs a,b), or leave --outputs out to store them all")
    return EncodeModel(loaded, chosen, {o: shapes[o] for o in chosen}, precision, inputs)


def _named_on_tokens(loaded, tokens) -> dict:
    """{output name: tensor} of a text encoder on int64 [B, 2, LENGTH] (ids, mask): the budget's call of it."""
    from nblib.budget.traced_jobs import call_on_tokens
    from nblib.models.outputs import named_outputs

    return named_outputs(call_on_tokens(loaded.module, tokens))

