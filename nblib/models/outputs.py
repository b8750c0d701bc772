"""A model's forward result as named tensors, whatever form it takes, so encode can store each by name.

The forms and the names they give: "Outputs" in docs/your-model.md. Tuples inside a dict (`hidden_states`
with output_hidden_states=True) become `hidden_states.0`, ...; None is dropped. Anything else is refused with
its type and where it was found: a silent skip would store less than the model gave.
"""
from __future__ import annotations

from collections import OrderedDict

from nblib.errors import ModelOutputError


def named_outputs(result) -> OrderedDict:
    """The forward `result` as an ordered dict {name: tensor} (ModelOutputError for what is no tensor)."""
    import torch

    named: OrderedDict = OrderedDict()
    if isinstance(result, torch.Tensor):
        named["output"] = result
    elif isinstance(result, dict):      # transformers.ModelOutput is an OrderedDict
        for key, value in result.items():
            _add(named, str(key), value)
    elif isinstance(result, (tuple, list)):
        _add(named, "output", result)
    else:
        raise ModelOutputError(f"the model's forward returned {type(result).__name__}; nblib takes a tensor, "
                               f"a dict of tensors or a transformers ModelOutput: wrap the model so its "
                               f"forward returns one of those")
    if not named:
        raise ModelOutputError("the model's forward returned no tensor (every output was None); "
                               "return at least one tensor")
    return named


def _add(named: OrderedDict, name: str, value) -> None:
    import torch

    if value is None:
        return
    if isinstance(value, torch.Tensor):
        if name in named:
            raise ModelOutputError(f"two outputs are named {name!r}; give the model's outputs distinct names")
        named[name] = value
    elif isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            _add(named, f"{name}.{i}", item)
    else:
        raise ModelOutputError(f"output {name!r} is a {type(value).__name__}, not a tensor; return tensors only "
                               f"(or None for an absent output)")
