"""Models whose submodules are called with keyword arguments, importable as ``support.kwargs_models:<factory>``.

``tiny_llama`` is a random-init Hugging Face Llama (its attention modules get
keyword arguments only); ``keyword_block`` is plain torch with keyword tensors,
a nested pair and non-tensor keywords, called both ways.
"""

from __future__ import annotations

import torch
from torch import nn

from layertap.server.host.sources import InputSpec, LoadedModel

#: Token ids per row in the tests' batches.
TOKENS = 8
VOCAB = 64


class _Opaque:
    """Stands in for a cache object: no tensor a hook should report."""


class Block(nn.Module):
    """Takes ``x`` and keyword tensors: ``scale``, a ``pair`` of tensors and non-tensors."""

    def forward(self, x: torch.Tensor | None = None, *, scale: torch.Tensor, pair: tuple[torch.Tensor, torch.Tensor],
                cache: object = None, flag: bool = False) -> torch.Tensor:
        assert x is not None
        return x * scale + pair[0] - pair[1]


class KeywordBlock(nn.Module):
    """Calls ``kw`` with keywords only and ``pos`` with a positional tensor and keywords."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.kw = Block()
        self.pos = Block()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        h = self.kw(x=h, scale=h.sigmoid(), pair=(h.cos(), h.sin()), cache=_Opaque(), flag=True)
        return self.pos(h, scale=h.tanh(), pair=(h, h * 0.5))


def keyword_block(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return KeywordBlock().eval()


def keyword_block_loaded() -> LoadedModel:
    return LoadedModel(keyword_block(), "keyword-block", "factory", [InputSpec("input", torch.float32, (-1, 8))])


class TinyLlama(nn.Module):
    """A 2-layer Llama (hidden 32) taking token ids positionally, as the host calls models."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaModel  # imported by the tests that serve it only: slow

        config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        self.model = LlamaModel(config)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.model(input_ids=input_ids).last_hidden_state
        return out


def tiny_llama(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return TinyLlama().eval()


def tiny_llama_loaded(seed: int = 0) -> LoadedModel:
    return LoadedModel(tiny_llama(seed), "tiny-llama", "factory", [InputSpec("input_ids", torch.int64, (-1, TOKENS))])
