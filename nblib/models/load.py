"""`load_model(spec)`: any torch module from a string, built with seeded random weights, nothing downloaded.

The model sources (`SOURCES`, the `--model` argument) and what each builds: "The model contract" in
docs/your-model.md. A new source is one `ModelSource` in `SOURCES`: its parser, its builder and its help
line; every `--model` help text and every refusal of a spec lists the forms from it (`spec_forms`).
Random weights come from `seed` in a forked RNG (the caller's RNG is untouched); `weights=` loads a
safetensors or torch state dict strictly over them.
Trade-off: transformers and timm are imported only here, so a missing one fails at the model, not at
`import nblib`, with the install line in the message.
"""
from __future__ import annotations

import dataclasses
import difflib
import importlib
import json
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from nblib.config import ModelConfig, PipelineConfig, preset
from nblib.errors import MissingDependency, ModelSpecError, NblibError, one_line
from nblib.models.identity import hf_config_dict, model_identity, module_config
from nblib.models.preprocessing import (
    Preprocessing,
    hf_processor_defaults,
    preprocessing_from,
    preprocessing_from_hf,
    preprocessing_from_timm,
    trm_preprocessing,
)
from nblib.models.weights import load_weights

DEFAULT_SPEC = "trm"
TRANSFORMERS_PIN = "transformers==5.24.0"
TIMM_FIX = ("timm needs torchvision built for the installed torch: pip install timm torchvision "
            "--index-url https://download.pytorch.org/whl/cpu (a CPU torch), or the matching CUDA wheel; "
            "or use hf:CLASS (transformers) or package.module:factory")


@dataclass
class LoadedModel:
    """A model ready to run: the module, how its input is made, and what it is (for the run's identity)."""

    module: object                     # torch.nn.Module (torch imported lazily)
    spec: str
    kind: str                          # "trm", "hf", "timm" or "factory"
    preprocessing: Preprocessing
    config: dict | None                # JSON-able: what built the module
    weights: str | None = None         # the weights file loaded over the seeded initial weights

    def __call__(self, images) -> OrderedDict:
        """uint8 [B, H, W, 3] -> {output name: tensor} (see nblib.models.outputs)."""
        from nblib.models.outputs import named_outputs

        return named_outputs(self.module(self.preprocessing.apply(images)))

    def output_shapes(self, image_size: int) -> dict[str, tuple[int, ...]]:
        """{output name: shape of one sample's output} for cache images of `image_size`, from a CPU forward."""
        import torch

        images = torch.zeros(2, image_size, image_size, 3, dtype=torch.uint8)
        with torch.no_grad():
            outputs = self(images)
        return {name: tuple(t.shape[1:]) for name, t in outputs.items()}

    def identity(self) -> dict:
        return model_identity(self.module, self.spec, self.preprocessing, config=self.config)


def load_model(spec: str | None = None, weights: str | Path | None = None, *, config=None, seed: int = 0,
               preprocessing: Preprocessing | dict | None = None, inputs: str = "images") -> LoadedModel:
    """The model `spec` names (DEFAULT_SPEC: the TRM), its weights loaded when a file is given.

    config: the run's PipelineConfig (or ModelConfig) for the TRM; seed: the random weights' seed
    (the TRM takes its config's run seed); preprocessing overrides the derived one; inputs: what the model is
    called with, "images" (a batch of images) or "tokens" (input_ids and attention_mask: a text encoder, whose
    transformers class is then refused unless its forward takes input_ids first).
    ModelSpecError for a bad spec, MissingDependency for an absent package, WeightsError for weights
    of another model.
    """
    spec = (spec or DEFAULT_SPEC).strip()
    source, rest = _source(spec)
    loaded = source.build(spec, rest, config=config, seed=seed, inputs=inputs)
    if preprocessing is not None:
        loaded.preprocessing = preprocessing_from(preprocessing)
    if weights is not None:
        load_weights(loaded.module, weights, loaded.config["model"] if loaded.kind == "trm" else None)
        loaded.weights = str(weights)
    loaded.module.eval()
    return loaded


def parse_spec(spec: str) -> tuple[str, str]:
    """(kind, rest) of a spec: kind names its source in SOURCES; ModelSpecError for another form."""
    source, rest = _source((spec or DEFAULT_SPEC).strip())
    return source.kind, rest


def names_trm(model) -> bool:
    """Whether `model` (a spec, a LoadedModel, an nn.Module; None: the default) is the suite's TRM."""
    return model is None or getattr(model, "kind", None) == "trm" or \
        (isinstance(model, str) and (not model.strip() or model.strip().partition(":")[0] == "trm"))


def spec_forms(last: str = "or") -> str:
    """Every source's spec forms in one phrase, for help texts and refusals: "trm, trm:PRESET, ... or X"."""
    forms = [form for source in SOURCES for form in source.forms]
    return f"{', '.join(forms[:-1])} {last} {forms[-1]}"


def _source(spec: str) -> tuple[ModelSource, str]:
    for source in SOURCES:
        if (rest := source.parse(spec)) is not None:
            return source, rest
    raise ModelSpecError(f"model spec {spec!r} is not one nblib knows; write {spec_forms()}")


def _prefixed(prefix: str, placeholder: str = "", noun: str = ""):
    """The parser of `prefix[:REST]` specs; with a `placeholder`, a bare `prefix:` is refused naming it."""
    def parse(spec: str) -> str | None:
        head, _, rest = spec.partition(":")
        if head != prefix:
            return None
        if not rest and placeholder:
            raise ModelSpecError(f"model spec {spec!r} names no {noun}; write {prefix}:{placeholder} "
                                 f"(e.g. hf:ViTModel)")
        return rest
    return parse


def _factory_spec(spec: str) -> str | None:
    head, sep, rest = spec.partition(":")
    dotted = all(part.isidentifier() for part in head.split(".")) and all(p.isidentifier() for p in rest.split("."))
    return spec if sep and head and rest and dotted else None


def seeded(seed: int, build):
    """`build()` under torch seed `seed`, leaving the caller's CPU random state as it was."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


def _build_trm(spec: str, rest: str, *, config, seed: int, inputs: str) -> LoadedModel:
    from nblib.trm import TRMVisionEncoder

    if rest:
        config = preset(rest)
    config = config if config is not None else PipelineConfig()
    if not isinstance(config, (PipelineConfig, ModelConfig)):
        raise ModelSpecError(f"the TRM takes a PipelineConfig or ModelConfig, not {type(config).__name__}")
    trm_seed = config.run.seed if isinstance(config, PipelineConfig) else seed
    module = TRMVisionEncoder(config, seed=trm_seed)
    shape = dataclasses.asdict(module.config)
    return LoadedModel(module, spec, "trm", trm_preprocessing(module.config.image_size),
                       {"model": shape, "seed": trm_seed})


def _build_hf(spec: str, rest: str, *, config, seed: int, inputs: str = "images") -> LoadedModel:
    import torch

    transformers = _import_transformers()
    class_name, _, config_path = rest.partition(":")
    cls = getattr(transformers, class_name, None) if class_name.isidentifier() else None
    if cls is None:
        close = difflib.get_close_matches(class_name, [n for n in dir(transformers) if n.endswith("Model")], n=3)
        hint = f"; close: {', '.join(close)}" if close else ""
        raise ModelSpecError(f"transformers {transformers.__version__} has no class {class_name!r}{hint}; "
                             f"name a model class such as ViTModel, ResNetModel, ConvNextModel, CLIPVisionModel")
    if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module) and getattr(cls, "config_class", None)):
        raise ModelSpecError(f"transformers.{class_name} is not a model class (an nn.Module with a "
                             f"config_class); name one such as ViTModel")
    _takes_first(cls, "pixel_values" if inputs == "images" else "input_ids", transformers)
    hf_config = _hf_config(cls, config_path) if config_path else cls.config_class()
    module = _built(seed, lambda: cls(hf_config), f"{spec} (transformers.{class_name}({cls.config_class.__name__}))",
                    "pass a config it builds from (hf:CLASS:config.json)")
    pre = preprocessing_from_hf(hf_config, hf_processor_defaults(hf_config))
    return LoadedModel(module, spec, "hf", pre, hf_config_dict(hf_config))


def _hf_config(cls, path: str):
    file = Path(path)
    if not file.is_file():
        raise ModelSpecError(f"config {file} for {cls.__name__} does not exist; pass a config.json "
                             f"(e.g. written by {cls.config_class.__name__}().to_json_file(path))")
    try:
        data = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelSpecError(f"config {file} is not JSON ({exc}); write it with "
                             f"{cls.config_class.__name__}().to_json_file(path)") from None
    expected = getattr(cls.config_class, "model_type", "")
    if not isinstance(data, dict) or data.get("model_type", expected) != expected:
        found = data.get("model_type") if isinstance(data, dict) else type(data).__name__
        raise ModelSpecError(f"config {file} is for model_type {found!r}; {cls.__name__} takes "
                             f"{expected!r}: pass that model's config, or name the class it is for")
    try:
        return cls.config_class.from_dict(data)
    except Exception as exc:   # noqa: BLE001 - a config class may refuse a field with any error
        raise ModelSpecError(f"config {file} does not build a {cls.config_class.__name__} "
                             f"({type(exc).__name__}: {one_line(exc, 300)}); fix that field") from None


def _takes_first(cls, first: str, transformers) -> None:
    """Refuse a class whose forward does not take `first` first: pixel_values for images (CLIPModel takes
    input_ids, text and images: nblib calls a model with one batch of images), input_ids for token inputs
    (a text encoder, not an image model).
    """
    import inspect

    names = [n for n in inspect.signature(cls.forward).parameters if n != "self"]
    if names[:1] == [first]:
        return
    takes = f"transformers.{cls.__name__}.forward takes {', '.join(names[:3])}, ... (not {first} first)"
    if first == "input_ids":
        raise ModelSpecError(f"{takes}: token inputs are for text encoders (BertModel, RobertaModel, ...); drop "
                             f"--input tokens:N for an image model")
    tower = f"{cls.__name__.removesuffix('Model')}VisionModel"
    fix = (f"use its image tower, hf:{tower}" if hasattr(transformers, tower) else
           "name a vision model whose forward takes pixel_values first (ViTModel, ResNetModel, ...)")
    raise ModelSpecError(f"{takes}: nblib calls a model with images alone; {fix}")


def _built(seed: int, build, what: str, fix: str):
    """`build()` under the seed; what it raises as one line (MissingDependency for an ImportError)."""
    try:
        return seeded(seed, build)
    except NblibError:
        raise
    except ImportError as exc:
        raise MissingDependency(f"{what} needs a package that does not import here "
                                f"({one_line(exc, 300)}); install it, or {fix}") from None
    except Exception as exc:   # noqa: BLE001 - the user's code may raise anything: one line, not a traceback
        raise ModelSpecError(f"{what} raised {type(exc).__name__}: {one_line(exc, 300)}; {fix}") from None


def _import_transformers():
    try:
        import transformers
    except ImportError as exc:
        raise MissingDependency(f"hf: models need transformers, which does not import here ({exc}): "
                                f"pip install {TRANSFORMERS_PIN}") from None
    return transformers


def _build_timm(spec: str, name: str, *, config, seed: int, inputs: str) -> LoadedModel:
    try:
        import timm
        import timm.data
    except Exception as exc:   # noqa: BLE001 - absent, or torchvision's wheel failing against this torch
        raise MissingDependency(f"timm:{name} needs timm, which does not import here "
                                f"({type(exc).__name__}: {str(exc)[:160]}); {TIMM_FIX}") from None
    try:
        module = seeded(seed, lambda: timm.create_model(name, pretrained=False))
    except RuntimeError as exc:
        raise ModelSpecError(f"timm has no model {name!r} ({exc}); list them with timm.list_models()") from None
    pre = preprocessing_from_timm(timm.data.resolve_data_config({}, model=module))
    return LoadedModel(module, spec, "timm", pre, {"name": name, "timm_version": str(timm.__version__)})


def _build_factory(spec: str, rest: str, *, config, seed: int, inputs: str) -> LoadedModel:
    import torch

    module_name, _, attr = rest.partition(":")
    try:
        target = importlib.import_module(module_name)
    except ImportError as exc:
        raise ModelSpecError(f"model factory {spec!r}: module {module_name!r} does not import ({exc}); put its "
                             f"folder on PYTHONPATH (or install it), or fix the spec") from None
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ModelSpecError(f"model factory {spec!r}: {module_name} has no {attr!r}; name a callable "
                                 f"that returns an nn.Module")
        target = getattr(target, part)
    if not callable(target):
        raise ModelSpecError(f"model factory {spec!r} is a {type(target).__name__}, not a callable")
    _no_arguments(spec, target)
    module = _built(seed, target, f"model factory {spec!r}", "fix the factory (nblib calls it with no arguments, "
                    "under a seeded RNG)")
    if not isinstance(module, torch.nn.Module):
        raise ModelSpecError(f"model factory {spec!r} returned a {type(module).__name__}, not a "
                             f"torch.nn.Module; return the module itself")
    return module_model(module, spec, "factory")


def module_model(module, spec: str, kind: str) -> LoadedModel:
    """A built module as a LoadedModel: its own `preprocessing` (a Preprocessing or a dict of its fields)
    or the default, and its config when it carries one.
    """
    pre = getattr(module, "preprocessing", None)
    pre = preprocessing_from(pre) if pre is not None else Preprocessing()
    return LoadedModel(module, spec, kind, pre, module_config(module))


def _no_arguments(spec: str, target) -> None:
    """Refuse a factory that needs an argument: nblib calls it with none."""
    import inspect

    try:
        params = inspect.signature(target).parameters.values()
    except (TypeError, ValueError):     # a builtin without a signature: call it and see
        return
    needed = [p.name for p in params if p.default is p.empty
              and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if needed:
        raise ModelSpecError(f"model factory {spec!r} needs {', '.join(needed)}, and nblib calls it with no "
                             f"arguments: give them defaults, or name a function of none that calls it "
                             f"(def build(): return {target.__name__}({', '.join(f'{n}=...' for n in needed)}))")


@dataclass(frozen=True)
class ModelSource:
    """One way to name a model: the spec forms it reads (for help and refusals), a line on what it builds,
    its parser (a spec -> what its builder takes, None when the spec is another source's) and its builder.
    """

    kind: str
    forms: tuple[str, ...]
    builds: str
    parse: Callable[[str], str | None]
    build: Callable[..., LoadedModel]


SOURCES: list[ModelSource] = [    # tried in order: the first whose parser takes the spec builds it
    ModelSource("trm", ("trm", "trm:PRESET"), "the suite's TRM encoder, shaped by the run's config or a preset",
                _prefixed("trm"), _build_trm),
    ModelSource("hf", ("hf:CLASS", "hf:CLASS:config.json"), "a transformers class from its default config or a "
                "config file", _prefixed("hf", "CLASS", "class"), _build_hf),
    ModelSource("timm", ("timm:NAME",), "timm.create_model(NAME, pretrained=False), where timm imports",
                _prefixed("timm", "NAME", "model"), _build_timm),
    ModelSource("factory", ("package.module:factory",), "an importable callable that returns an nn.Module",
                _factory_spec, _build_factory),
]

