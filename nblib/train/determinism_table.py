"""torch's list of ops that raise under `torch.use_deterministic_algorithms(True)` on CUDA, as data, per release.

A copy of what `nblib.train.determinism.read_docstring` reads from torch's docstring, for when it cannot read it
(`python -OO` strips docstrings; a reworded docstring parses to too few entries): the check then uses this copy,
never an empty list. Each row: (documented name, "class" or "func", the condition as written, the modes it lists).
`tests/test_determinism_fallback.py` compares the copy of the installed torch's release with its docstring; for a
new release, add its rows as that test prints them.
"""
from __future__ import annotations

DOCUMENTED = {
    "2.13": (
        ('torch.nn.AvgPool3d', 'class', 'when attempting to differentiate a CUDA tensor', ()),
        ('torch.nn.AdaptiveAvgPool2d', 'class', 'when attempting to differentiate a CUDA tensor', ()),
        ('torch.nn.AdaptiveAvgPool3d', 'class', 'when attempting to differentiate a CUDA tensor', ()),
        ('torch.nn.AdaptiveMaxPool2d', 'class', 'when attempting to differentiate a CUDA tensor', ()),
        ('torch.nn.FractionalMaxPool2d', 'class', 'when attempting to differentiate a CUDA tensor', ()),
        ('torch.nn.FractionalMaxPool3d', 'class', 'when attempting to differentiate a CUDA tensor', ()),
        ('torch.nn.MaxUnpool1d', 'class', '', ()),
        ('torch.nn.MaxUnpool2d', 'class', '', ()),
        ('torch.nn.MaxUnpool3d', 'class', '', ()),
        ('torch.nn.functional.interpolate', 'func',
         'when attempting to differentiate a CUDA tensor and one of the following modes is used:',
         ('linear', 'bilinear', 'bicubic', 'trilinear')),
        ('torch.nn.ReflectionPad1d', 'class', 'when attempting to differentiate a CUDA tensor', ()),
        ('torch.nn.ReflectionPad2d', 'class', 'when attempting to differentiate a CUDA tensor', ()),
        ('torch.nn.ReflectionPad3d', 'class', 'when attempting to differentiate a CUDA tensor', ()),
        ('torch.nn.NLLLoss', 'class', 'when called on a CUDA tensor', ()),
        ('torch.nn.CTCLoss', 'class', 'when attempting to differentiate a CUDA tensor', ()),
        ('torch.nn.EmbeddingBag', 'class', "when attempting to differentiate a CUDA tensor when ``mode='max'``", ()),
        ('torch.Tensor.put_', 'func', 'when ``accumulate=False``', ()),
        ('torch.Tensor.put_', 'func', 'when ``accumulate=True`` and called on a CUDA tensor', ()),
        ('torch.histc', 'func', 'when called on a CUDA tensor', ()),
        ('torch.bincount', 'func', 'when called on a CUDA tensor and ``weights`` tensor is given', ()),
        ('torch.median', 'func', 'with indices output when called on a CUDA tensor', ()),
        ('torch.nn.functional.grid_sample', 'func', 'when attempting to differentiate a CUDA tensor', ()),
        ('torch.cumsum', 'func', 'when called on a CUDA tensor when dtype is floating point or complex', ()),
        ('torch.Tensor.scatter_reduce', 'func', "when ``reduce='prod'`` and called on CUDA tensor", ()),
        ('torch.Tensor.resize_', 'func', 'when called with a quantized tensor', ()),
    ),
}
