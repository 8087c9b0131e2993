"""Tiny random-init Hugging Face models, built from configs and saved with ``save_pretrained``.

Nothing is downloaded: every config is written here, the weights are random
(seeded), and each model is saved into a directory the test owns.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

#: name -> (config class, model class, config keywords, a decoder layer to capture)
TINY: dict[str, tuple[str, str, dict[str, Any], str]] = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel",
             {"vocab_size": 64, "n_positions": 32, "n_embd": 16, "n_layer": 2, "n_head": 2, "bos_token_id": 0, "eos_token_id": 0}, "transformer.h.0"),
    "llama": ("LlamaConfig", "LlamaForCausalLM",
              {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
               "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 32}, "model.layers.0"),
    "bert": ("BertConfig", "BertForSequenceClassification",
             {"vocab_size": 64, "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
              "intermediate_size": 32, "max_position_embeddings": 32, "num_labels": 3}, "bert.encoder.layer.0"),
    "vit": ("ViTConfig", "ViTForImageClassification",
            {"image_size": 16, "patch_size": 8, "num_channels": 3, "hidden_size": 16, "num_hidden_layers": 2,
             "num_attention_heads": 2, "intermediate_size": 32, "num_labels": 5}, "vit.layers.0"),
}


def build(kind: str, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """A random-init ``kind`` model from its config (with ``overrides``), in eval mode."""
    import transformers

    config_cls, model_cls, kwargs, _ = TINY[kind]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**{**kwargs, **overrides})
    model = getattr(transformers, model_cls)(config)
    return model.eval()


def save(kind: str, directory: Path, seed: int = 0, **overrides: Any) -> tuple[Path, torch.nn.Module]:
    """``save_pretrained`` a tiny ``kind`` into ``directory/kind``; the directory and the model."""
    model = build(kind, seed, **overrides)
    out = directory / kind
    model.save_pretrained(out)
    return out, model


def example_input(kind: str, batch: int = 2, tokens: int = 5, seed: int = 1) -> torch.Tensor:
    """The main input of ``kind``: token ids, or pixel values."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "vit":
        size = TINY[kind][2]["image_size"]
        return torch.randn(batch, 3, size, size, generator=gen)
    return torch.randint(0, TINY[kind][2]["vocab_size"], (batch, tokens), generator=gen)


def mark_remote_code(directory: Path) -> None:
    """Make ``directory``'s config name remote code (``auto_map``), as hub repos with custom models do."""
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config["auto_map"] = {"AutoConfig": "configuration_tiny.TinyConfig", "AutoModel": "modeling_tiny.TinyModel"}
    path.write_text(json.dumps(config))
    # The code it names: never run by the tests (the flag is not given).
    (directory / "modeling_tiny.py").write_text("raise RuntimeError('remote code ran')\n")
    (directory / "configuration_tiny.py").write_text("raise RuntimeError('remote code ran')\n")


def factory_with_args(width: int = 4, name: str = "x", scale: float = 1.0) -> torch.nn.Module:
    """A factory that records its arguments, for ``--model-arg`` (``support.hf_models:factory_with_args``)."""
    model = torch.nn.Sequential(torch.nn.Linear(width, width))
    model.factory_args = {"width": width, "name": name, "scale": scale}  # type: ignore[assignment]
    return model


def save_word_tokenizer(directory: Path, vocab_size: int) -> Any:
    """A word-level tokenizer (``w0`` .. ``w{n-1}``, split on spaces), built here and saved into ``directory``.

    Built with ``tokenizers`` and wrapped as transformers' fast tokenizer, so
    ``AutoTokenizer.from_pretrained(directory)`` loads it; nothing downloads.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(vocab_size)}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="w1"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="w1")
    tok.save_pretrained(directory)
    return tok
