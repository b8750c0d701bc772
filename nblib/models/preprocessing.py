"""How a model's input is made from the cache's images (uint8 NHWC), declared as data and fingerprinted.

A `Preprocessing` is a frozen record: the input layout the model takes (raw uint8 NHWC, as the TRM
does, or float NCHW), the size to resize to, the interpolation, the scale and the per-channel mean
and std. Its fingerprint covers every field that changes the model's input bytes (not `source`,
which only says where the values came from), so a run's identity changes when the input does.
Defaults come from where the model comes from, without a download: a transformers model's config
(`image_size`) and its image processor's class defaults (mean, std, resample), timm's data config.
Trade-off: one resize of the whole (square) image, no crop; a processor's crop is applied as a
resize to the crop size, which matches it only for images already at the processor's size.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from nblib.atomic import sha256_json
from nblib.errors import ConfigError

LAYOUTS = ("uint8_nhwc", "float_nchw")
INTERPOLATIONS = ("nearest", "bilinear", "bicubic")
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
_PIL_RESAMPLE = {0: "nearest", 2: "bilinear", 3: "bicubic"}   # PIL.Image.Resampling values


@dataclass(frozen=True)
class Preprocessing:
    """uint8 [B, H, W, 3] -> the model's input; every field but `source` is in the fingerprint.

    layout: "uint8_nhwc" passes the images as they are (the model scales them itself, as the TRM
    does; `size` is then a check); "float_nchw" resizes to `size` (None keeps the input size),
    multiplies by `scale`, subtracts `mean`, divides by `std` and puts channels first.
    """

    layout: str = "float_nchw"
    size: tuple[int, int] | None = None
    interpolation: str = "bilinear"
    scale: float = 1 / 255
    mean: tuple[float, ...] = (0.0, 0.0, 0.0)
    std: tuple[float, ...] = (1.0, 1.0, 1.0)
    antialias: bool = True
    source: str = "default: [0, 1] float NCHW at the input size"

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ConfigError(f"preprocessing layout {self.layout!r} is unknown; choose one of {LAYOUTS}")
        if self.interpolation not in INTERPOLATIONS:
            raise ConfigError(f"preprocessing interpolation {self.interpolation!r} is unknown; "
                              f"choose one of {INTERPOLATIONS}")
        if self.size is not None:
            size = (self.size, self.size) if isinstance(self.size, int) else tuple(int(s) for s in self.size)
            if len(size) != 2 or min(size) < 1:
                raise ConfigError(f"preprocessing size {self.size!r} is not (height, width) of positive ints")
            object.__setattr__(self, "size", size)
        object.__setattr__(self, "mean", tuple(float(m) for m in self.mean))
        object.__setattr__(self, "std", tuple(float(s) for s in self.std))
        if len(self.mean) != 3 or len(self.std) != 3 or min(self.std) <= 0:
            raise ConfigError(f"preprocessing mean {self.mean} and std {self.std} must be 3 values each "
                              f"(R, G, B), std > 0")

    def fields(self) -> dict:
        """Every field that changes the model's input, as JSON-able data (what the fingerprint hashes)."""
        data = dataclasses.asdict(self)
        data.pop("source")
        data["size"] = list(self.size) if self.size else None
        data["mean"], data["std"] = list(self.mean), list(self.std)
        return data

    def fingerprint(self) -> str:
        """sha256 of the fields (key-sorted JSON): equal for equal preprocessing, whatever its source."""
        return sha256_json(self.fields())

    def apply(self, images):
        """uint8 [B, H, W, 3] tensor -> the model's input tensor (on the images' device)."""
        import torch
        import torch.nn.functional as F

        if images.dim() != 4 or images.shape[-1] != 3 or images.dtype != torch.uint8:
            raise ConfigError(f"preprocessing takes uint8 images [B, H, W, 3]; got {images.dtype} "
                              f"{list(images.shape)}")
        if self.layout == "uint8_nhwc":
            if self.size is not None and tuple(images.shape[1:3]) != self.size:
                raise ConfigError(f"images are {images.shape[1]}x{images.shape[2]}, the model takes "
                                  f"{self.size[0]}x{self.size[1]} uint8 images; re-render the cache at that size")
            return images
        x = images.permute(0, 3, 1, 2).float()
        if self.size is not None and tuple(x.shape[2:]) != self.size:
            align = None if self.interpolation == "nearest" else False
            x = F.interpolate(x, size=self.size, mode=self.interpolation, align_corners=align,
                              antialias=self.antialias and self.interpolation != "nearest")
        # built on the CPU, then moved: a fake CUDA device (nblib.budget.trace) cannot build from a list
        mean = torch.tensor(self.mean).view(1, 3, 1, 1).to(x.device)
        std = torch.tensor(self.std).view(1, 3, 1, 1).to(x.device)
        return ((x * self.scale - mean) / std).contiguous()


def preprocessing_from(value) -> Preprocessing:
    """A Preprocessing from itself or from a dict of its fields (ConfigError naming an unknown field)."""
    if isinstance(value, Preprocessing):
        return value
    if isinstance(value, dict):
        known = {f.name for f in dataclasses.fields(Preprocessing)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(f"preprocessing fields {unknown} are unknown; known: {sorted(known)}")
        return Preprocessing(**value)
    raise ConfigError(f"preprocessing must be a Preprocessing or a dict of its fields, not {type(value).__name__}")


def trm_preprocessing(image_size: int) -> Preprocessing:
    """The TRM's input: the cache's uint8 NHWC images as they are (it patchifies and scales them)."""
    return Preprocessing(layout="uint8_nhwc", size=(image_size, image_size), interpolation="nearest",
                         scale=1.0, source="nblib.trm: uint8 NHWC, scaled by the model (patchify / 255)")


def preprocessing_from_hf(config, processor_defaults: dict | None) -> Preprocessing:
    """From a transformers config (its `image_size`) and its image processor's class defaults.

    `processor_defaults` is `hf_processor_defaults(config)` (None: no processor class is known for
    the model type, so ImageNet's mean and std and bilinear resizing are used, and said so).
    """
    size = _config_size(config)
    where = "config.image_size" if size else ""
    if processor_defaults is None:
        return Preprocessing(size=size, mean=IMAGENET_MEAN, std=IMAGENET_STD,
                             source=f"transformers {type(config).__name__}: {where or 'input size kept'}; "
                                    f"no image processor known for the model type: ImageNet mean/std, bilinear")
    if size is None:
        size, where = _processor_size(processor_defaults)
    name = processor_defaults["class"]
    return Preprocessing(size=size, interpolation=processor_defaults["interpolation"],
                         scale=processor_defaults["scale"], mean=processor_defaults["mean"],
                         std=processor_defaults["std"],
                         source=f"transformers {type(config).__name__} + {name} defaults (size from {where})")


def hf_processor_defaults(config) -> dict | None:
    """The class defaults of the image processor transformers pairs with `config`'s model type (no download)."""
    import transformers
    from transformers.models.auto import image_processing_auto

    names = image_processing_auto.IMAGE_PROCESSOR_MAPPING_NAMES
    model_type = getattr(config, "model_type", "")
    entry = names.get(model_type) or names.get(model_type.removesuffix("_vision_model"))
    if not entry:
        return None
    candidates = [entry.get("pil"), entry.get("torchvision")] if isinstance(entry, dict) else list(entry)
    for class_name in filter(None, candidates):
        cls = getattr(transformers, class_name, None)
        try:
            processor = cls()
        except Exception:   # noqa: BLE001 - a backend this install lacks (torchvision): try the next
            continue
        return _processor_fields(class_name, processor)
    return None


def preprocessing_from_timm(data_config: dict) -> Preprocessing:
    """From timm's data config (`timm.data.resolve_data_config({}, model=model)`): input_size, mean, std."""
    try:
        _, height, width = data_config["input_size"]
        interpolation = data_config.get("interpolation", "bicubic")
        return Preprocessing(size=(height, width),
                             interpolation=interpolation if interpolation in INTERPOLATIONS else "bicubic",
                             mean=data_config["mean"], std=data_config["std"],
                             source="timm data config (resolve_data_config)")
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"timm data config {data_config!r} lacks input_size (C, H, W), mean or std "
                          f"({exc}); pass preprocessing= explicitly") from None


def _config_size(config) -> tuple[int, int] | None:
    size = getattr(config, "image_size", None)
    if isinstance(size, int):
        return (size, size)
    if isinstance(size, (list, tuple)) and len(size) == 2:
        return (int(size[0]), int(size[1]))
    return None


def _processor_size(defaults: dict) -> tuple[tuple[int, int] | None, str]:
    for key in ("crop_size", "size"):
        value = defaults.get(key) or {}
        if value.get("height") and value.get("width"):
            return (value["height"], value["width"]), f"{defaults['class']}.{key}"
        if value.get("shortest_edge"):
            edge = value["shortest_edge"]
            return (edge, edge), f"{defaults['class']}.{key}.shortest_edge"
    return None, "the input size (the processor declares none)"


def _processor_fields(class_name: str, processor) -> dict:
    def as_dict(value):
        if value is None:
            return None
        if isinstance(value, dict):
            return dict(value)
        return {k: getattr(value, k, None) for k in ("height", "width", "shortest_edge")}

    resample = getattr(processor, "resample", 2)
    return {"class": class_name, "size": as_dict(getattr(processor, "size", None)),
            "crop_size": as_dict(getattr(processor, "crop_size", None)),
            "interpolation": _PIL_RESAMPLE.get(int(getattr(resample, "value", resample)), "bilinear"),
            "scale": float(getattr(processor, "rescale_factor", 1 / 255) or 1 / 255)
            if getattr(processor, "do_rescale", True) else 1.0,
            "mean": tuple(processor.image_mean) if getattr(processor, "do_normalize", True) else (0.0,) * 3,
            "std": tuple(processor.image_std) if getattr(processor, "do_normalize", True) else (1.0,) * 3}
