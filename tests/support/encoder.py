"""A small transformer with long dotted module names, importable as ``support.encoder:text_encoder``.

Names such as ``encoder.layers.0.self_attn.out_proj`` (35 characters) and
types such as ``NonDynamicallyQuantizableLinear`` are what a narrow terminal
must show without cutting the name.
"""

from __future__ import annotations

import torch
from torch import nn

#: ``layertap serve --input-shape``: batch free, 8 tokens of width 32.
TEXT_ENCODER_INPUT_SHAPE = "-1,8,32"


class TextEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # SiLU keeps PyTorch off its fused fast path, so the inner modules
        # (self_attn, linear2, ...) run and their hooks fire.
        layer = nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, batch_first=True,
                                           activation=nn.SiLU())
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


def text_encoder() -> nn.Module:
    torch.manual_seed(0)
    return TextEncoder()
