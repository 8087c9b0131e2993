"""``--model hf:DIR``: a Hugging Face ``save_pretrained`` directory or hub id.

Loaded with transformers' own ``from_pretrained`` (config, safetensors, tied
weights), so the model is the one transformers would build. transformers is
imported only when an ``hf:`` model is asked for: the ``[server]`` install
works without it. This module knows nothing of :mod:`.sources`, which turns
its result into a ``LoadedModel`` (no import cycle).
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

#: Auto classes offered when a class is unknown, each listed with the concrete
#: class it maps the directory's config to (only those that map it).
AUTO_CLASSES: tuple[str, ...] = (
    "AutoModel", "AutoModelForCausalLM", "AutoModelForMaskedLM", "AutoModelForSeq2SeqLM",
    "AutoModelForSequenceClassification", "AutoModelForTokenClassification", "AutoModelForQuestionAnswering",
    "AutoModelForImageClassification",
)

#: Inputs besides the main one that a forward may take, all ``(batch, tokens)`` int64.
TOKEN_SIDE_INPUTS: tuple[str, ...] = ("attention_mask", "token_type_ids")

#: The switches that forbid transformers and huggingface_hub to download.
OFFLINE_SWITCHES: tuple[str, ...] = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


class HFLoadError(Exception):
    """An ``hf:`` model could not be loaded; the message is one line for the user."""


@dataclass
class HFModel:
    """A loaded Hugging Face model and its input signature, main input first.

    ``inputs`` holds ``(name, dtype, shape)`` with ``-1`` for free dimensions.
    """

    module: nn.Module
    name: str
    inputs: list[tuple[str, torch.dtype, tuple[int, ...]]]
    notes: list[str] = field(default_factory=list)
    #: The directory's tokenizer, when it holds one (text prompts and pieces for Generate).
    tokenizer: Any = None


def _transformers() -> Any:
    try:
        import transformers  # noqa: PLC0415 - optional dependency (layertap[hf]), only for hf: models
    except ImportError:
        raise HFLoadError("hf: models need transformers: pip install 'layertap[hf]'") from None
    return transformers


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else exc.__class__.__name__


def _offline_switch() -> str | None:
    for name in OFFLINE_SWITCHES:
        if os.environ.get(name, "").strip().upper() in {"1", "ON", "YES", "TRUE"}:
            return name
    return None


def _not_found(ref: str, exc: BaseException) -> HFLoadError:
    if Path(ref).exists():
        return HFLoadError(f"--model hf:{ref}: not a save_pretrained directory ({_first_line(exc)})")
    switch = _offline_switch()
    if switch is not None:
        return HFLoadError(f"--model hf:{ref}: {ref!r} is not a directory and not in the Hugging Face cache, "
                           f"and {switch}=1 forbids downloading it (unset {switch}, or pass a save_pretrained directory)")
    return HFLoadError(f"--model hf:{ref}: {ref!r} is not a directory, and the hub did not give it "
                       f"({_first_line(exc)})")


def _config_dict(tf: Any, ref: str) -> dict[str, Any]:
    """``config.json`` as a dict, read without running any of the directory's code."""
    try:
        config_dict, _ = tf.PretrainedConfig.get_config_dict(ref)
    except (OSError, ValueError) as exc:
        raise _not_found(ref, exc) from None
    return dict(config_dict)


def known_classes(tf: Any, config: Any) -> list[str]:
    """The classes ``--hf-class`` may name for ``config``: its ``architectures``, and each Auto class that maps it."""
    names = list(getattr(config, "architectures", None) or [])
    for auto in AUTO_CLASSES:
        mapping = getattr(getattr(tf, auto, None), "_model_mapping", None)
        try:
            target = mapping[type(config)] if mapping is not None else None
        except KeyError:
            continue
        if target is not None:
            names.append(f"{auto} ({target.__name__})")
    return names


def _model_class(tf: Any, ref: str, config: Any, hf_class: str | None, remote: dict[str, str]) -> Any:
    if remote:
        # Remote code is reached through the Auto classes its auto_map lists.
        name = hf_class or next((k for k in remote if k.startswith("AutoModel")), None)
        if name not in remote:
            raise HFLoadError(f"--hf-class {name!r}: the directory's auto_map lists {', '.join(remote)}")
        return getattr(tf, name)
    archs = list(getattr(config, "architectures", None) or [])
    name = hf_class or (archs[0] if archs else None)
    cls = getattr(tf, name, None) if name else None
    if not (isinstance(cls, type) and hasattr(cls, "from_pretrained") and hasattr(cls, "config_class")
            or name in AUTO_CLASSES):
        known = ", ".join(known_classes(tf, config)) or "none"
        what = f"--hf-class {name!r} is not a transformers model class" if name else \
            "its config names no architectures; pass --hf-class"
        raise HFLoadError(f"--model hf:{ref}: {what}; known classes for model_type "
                          f"{getattr(config, 'model_type', '?')!r}: {known}")
    return cls


def _dims(value: Any, count: int) -> tuple[int, ...]:
    if isinstance(value, int):
        return (value,) * count
    if isinstance(value, (list, tuple)) and len(value) == count and all(isinstance(v, int) for v in value):
        return tuple(value)
    return (-1,) * count


def input_signature(model: nn.Module) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """``main_input_name`` and the side inputs ``forward`` takes: name, dtype, shape (-1: free).

    Raises:
        HFLoadError: The main input is one this loader cannot describe.
    """
    main = str(getattr(model, "main_input_name", "input_ids"))
    params = inspect.signature(model.forward).parameters
    config = getattr(model, "config", None)
    if main == "input_ids":
        specs: list[tuple[str, torch.dtype, tuple[int, ...]]] = [(main, torch.int64, (-1, -1))]
        specs += [(n, torch.int64, (-1, -1)) for n in TOKEN_SIDE_INPUTS if n in params]
        return specs
    dtype = next((p.dtype for p in model.parameters() if p.dtype.is_floating_point), torch.float32)
    if main == "pixel_values":
        channels = getattr(config, "num_channels", -1)
        return [(main, dtype, (-1, channels if isinstance(channels, int) else -1,
                               *_dims(getattr(config, "image_size", None), 2)))]
    if main == "input_values":  # raw audio: (batch, samples)
        return [(main, dtype, (-1, -1))]
    raise HFLoadError(f"main input {main!r} is not supported yet (input_ids, pixel_values, input_values are)")


def load_pretrained(ref: str, *, hf_class: str | None = None, trust_remote_code: bool = False,
                    kwargs: dict[str, Any] | None = None) -> HFModel:
    """Load ``ref`` (a ``save_pretrained`` directory, or a hub id through transformers' cache) on the CPU.

    Args:
        hf_class: A transformers model or Auto class; default: the config's ``architectures[0]``.
        trust_remote_code: Run the directory's own Python (its ``auto_map``); refused without it.
        kwargs: More ``from_pretrained`` arguments (``--model-arg``).

    Raises:
        HFLoadError: With the reason, in one line.
    """
    tf = _transformers()
    remote = {str(k): str(v) for k, v in (_config_dict(tf, ref).get("auto_map") or {}).items()}
    if remote and not trust_remote_code:
        listed = ", ".join(f"{k} → {v}" for k, v in remote.items())
        raise HFLoadError(f"--model hf:{ref}: its config.json maps classes to code in the directory or on the hub "
                          f"(auto_map: {listed}); that code runs only with --trust-remote-code")
    try:
        config = tf.AutoConfig.from_pretrained(ref, trust_remote_code=trust_remote_code)
    except OSError as exc:
        raise _not_found(ref, exc) from None
    except Exception as exc:  # noqa: BLE001 - an unknown model_type, or remote code that raised
        raise HFLoadError(f"--model hf:{ref}: transformers cannot read its config "
                          f"({exc.__class__.__name__}: {_first_line(exc)})") from None
    cls = _model_class(tf, ref, config, hf_class, remote)
    try:
        model = cls.from_pretrained(ref, config=config, trust_remote_code=trust_remote_code, **(kwargs or {}))
    except OSError as exc:
        raise _not_found(ref, exc) from None
    except Exception as exc:  # noqa: BLE001 - from_pretrained raises many types; each is a start-up error
        raise HFLoadError(f"--model hf:{ref}: {cls.__name__}.from_pretrained raised "
                          f"{exc.__class__.__name__}: {_first_line(exc)}") from None
    inputs = input_signature(model)
    name = Path(ref).name if Path(ref).is_dir() else ref
    return HFModel(model, name or ref, inputs, notes=[f"{type(model).__name__} from {ref}"],
                   tokenizer=load_tokenizer(tf, ref, trust_remote_code))


#: Files any of which says a directory holds a tokenizer.
TOKENIZER_FILES: tuple[str, ...] = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(tf: Any, ref: str, trust_remote_code: bool = False) -> Any:
    """``AutoTokenizer.from_pretrained(ref)``, or None when ``ref`` is a directory with no tokenizer files.

    A tokenizer that fails to load is a start-up error: a model served without
    the tokenizer its directory ships would refuse every text prompt.
    """
    if Path(ref).is_dir() and not any((Path(ref) / f).exists() for f in TOKENIZER_FILES):
        return None
    try:
        return tf.AutoTokenizer.from_pretrained(ref, trust_remote_code=trust_remote_code)
    except Exception as exc:  # noqa: BLE001 - many types; each is one line for the user
        if not Path(ref).is_dir():
            return None  # a hub id without a tokenizer in the cache: serve ids only
        raise HFLoadError(f"--model hf:{ref}: its tokenizer does not load "
                          f"({exc.__class__.__name__}: {_first_line(exc)})") from None
