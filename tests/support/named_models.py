"""Factories of models with several named inputs and structured outputs, for ``--model support.named_models:NAME``.

Each factory seeds torch first, so a test builds the same weights locally.
"""

from __future__ import annotations

import torch
from torch import nn

VOCAB = 40


def tiny_bert() -> nn.Module:
    """A random-init 2-layer BERT: ``forward(input_ids, attention_mask)`` returns a ModelOutput."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=32)
    return BertModel(config).eval()


def tiny_gpt2() -> nn.Module:
    """A random-init 2-layer GPT-2 whose output holds a KV cache object."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=2, n_positions=32, use_cache=True,
                        bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config).eval()


class TupleWithNone(nn.Module):
    """Returns ``(2x, None, x + 1)``: the None keeps its place."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None, torch.Tensor]:
        y = self.scale(x)
        return y * 2, None, y + 1


def tuple_with_none() -> nn.Module:
    torch.manual_seed(0)
    return TupleWithNone().eval()


class ConvWithDictOutput(nn.Module):
    """An image classifier returning ``{"logits": ..., "other": ...}``, as a ModelOutput would."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Conv2d(3, 4, 3, padding=1)
        self.head = nn.Linear(4, 5)
        self.other_head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        pooled = self.body(x).mean(dim=(2, 3))
        return {"logits": self.head(pooled), "other": self.other_head(pooled)}


def conv_with_dict_output() -> nn.Module:
    torch.manual_seed(0)
    return ConvWithDictOutput().eval()
