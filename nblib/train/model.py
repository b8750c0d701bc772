"""What is trained: the TRM encoder with a linear head on its pooled sketches, run the TRM way.

Tiny Recursive Models train with the first H_cycles-1 outer cycles under `torch.no_grad()` and
back-propagate through the last one only: compute grows with H_cycles, the activations kept for
backward do not (one outer cycle: L_cycles+1 passes through the block stack). That forward is
`TRMVisionEncoder.sketches(images, grad_last_cycle_only=True)`, the encoder's own recursion, so the
encoder's weights (saved with `save_weights`) are what `python -m nblib encode --weights` loads.
Inference (`encode`) runs every cycle and gives the same sketches for the same weights.
"""
from __future__ import annotations

import torch
from torch import nn

from nblib.config import ModelConfig
from nblib.trm import TRMVisionEncoder

HEAD_SEED_SALT = 0x4EAD


class Classifier(nn.Module):
    """TRMVisionEncoder, then BatchNorm1d, dropout and Linear(dim, classes) over the mean capsule sketch.

    At initialization the recursive stack maps every image to nearly the same sketch (the
    across-image spread is ~5% of the sketch's scale at the smoke size): a batch norm over the
    images centres and rescales that spread, which a LayerNorm (per image) cannot. Its running
    statistics use momentum 0.5 so evaluation follows the quickly changing encoder.
    """

    def __init__(self, model: ModelConfig, n_classes: int, seed: int = 0, dropout: float = 0.1):
        super().__init__()
        self.encoder = TRMVisionEncoder(model, seed=seed)
        self.head_norm = nn.BatchNorm1d(model.dim, momentum=0.5)
        self.head_drop = nn.Dropout(dropout)
        self.head = nn.Linear(model.dim, n_classes)
        gen = torch.Generator().manual_seed(seed ^ HEAD_SEED_SALT)
        with torch.no_grad():
            self.head.weight.copy_(torch.randn(self.head.weight.shape, generator=gen) * model.dim ** -0.5)
            self.head.bias.zero_()
        for name, param in self.encoder.named_parameters():
            if name in untrained_names(model):
                param.requires_grad_(False)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 [B, H, W, 3] -> logits [B, classes]."""
        sketches = self.encoder.sketches(images, grad_last_cycle_only=True)
        return self.head(self.head_drop(self.head_norm(sketches.mean(dim=1))))


def untrained_names(model: ModelConfig) -> set[str]:
    """Encoder parameters no gradient reaches here: the children head (only sketches are trained) and,
    with H_cycles > 1, the initial states (used only inside the no-grad cycles). Frozen, so DDP
    does not wait for their gradients.
    """
    names = {"children_head.weight", "children_head.bias"}
    return names | ({"z_H_init", "z_L_init"} if model.H_cycles > 1 else set())
