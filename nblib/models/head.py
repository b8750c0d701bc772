"""A classification head on any model: on a named output, or the model's own logits.

`with_head(loaded, n_classes, output=None)` returns a module whose forward takes the cache's uint8
[B, H, W, 3] images and returns logits [B, n_classes]. The feature is the named output (default:
"logits" when the model has them, used as they are; else "pooler_output", else the first output),
reduced to [B, F]: [B, T, D] by the mean over tokens, [B, C, H, W] by the mean over space. The
budget's trace (nblib.budget.model_vram) and the simulated step (nblib.simulate.model) train it.
"""
from __future__ import annotations

from nblib.errors import ConfigError


def with_head(loaded, n_classes: int, output: str | None = None, *, image_size: int | None = None):
    """The LoadedModel's module with preprocessing in front and a Linear head on `output` (see module doc)."""
    import torch
    from torch import nn

    from nblib.models.outputs import named_outputs

    size = image_size or _image_size(loaded)
    with torch.no_grad():
        outs = loaded(torch.zeros(1, size, size, 3, dtype=torch.uint8))
    name = output or ("logits" if "logits" in outs else "pooler_output" if "pooler_output" in outs
                      else next(iter(outs)))
    if name not in outs:
        raise ConfigError(f"the model has no output {name!r}; its outputs are {list(outs)}")
    features = _reduce(outs[name]).shape[1]
    own_logits = name == "logits" and features == n_classes

    class WithHead(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = loaded.module
            self.head = nn.Identity() if own_logits else nn.Linear(features, n_classes)
            self.output, self.own_logits = name, own_logits      # what the head reads (a run's identity)

        def forward(self, images):
            return self.head(_reduce(named_outputs(self.model(loaded.preprocessing.apply(images)))[name]))

    return WithHead()


def _reduce(t):
    if t.dim() == 3:
        return t.mean(dim=1)
    if t.dim() == 4:
        return t.mean(dim=(2, 3))
    return t.flatten(1)


def _image_size(loaded) -> int:
    size = getattr(loaded.preprocessing, "size", None)
    if size:
        return int(size[0])
    config = loaded.config or {}
    return int(config.get("model", {}).get("image_size") or config.get("image_size") or 224)
