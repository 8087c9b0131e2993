"""Loading the model to host: the demo, torchvision, torch.export, TorchScript, factories, Hugging Face.

Every source resolves to a :class:`LoadedModel`: the module, its input
signature and whether module hooks work on it. Loading errors are raised as
:class:`ModelLoadError` with a one-line message that the CLI prints as is.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from layertap.server.codec import DTYPE_BY_NAME
from layertap.server.host import hf
from layertap.server.host.demo_model import DEMO_INPUT_SHAPE, build_demo_model


class ModelLoadError(Exception):
    """The model could not be loaded; the message is one line for the user."""


@dataclass(frozen=True)
class InputSpec:
    """One declared input: ``name`` is ``forward``'s parameter (or the program's
    placeholder); ``-1`` in ``shape`` marks a free dimension (batch, sequence)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    #: False for an input ``forward`` defaults (an ``hf:`` model's ``attention_mask``).
    required: bool = True
    #: Reaches ``forward`` by keyword even when sent unnamed: its position in
    #: ``forward`` is not its place among the declared inputs (GPT-2's second
    #: parameter is its cache, not the mask).
    keyword: bool = False
    #: Token ids must lie in ``[0, vocab)``: checked before the forward, where
    #: an embedding lookup would fail with an opaque index error.
    vocab: int | None = None
    #: The input whose shape this one must have (an attention_mask, the ids').
    shape_of: str | None = None


@dataclass
class LoadedModel:
    """A model ready to be hosted."""

    module: nn.Module
    name: str
    source: str
    inputs: list[InputSpec]
    hooks_supported: bool = True
    #: False when ``forward`` takes its inputs by position only (a ``.pt2``
    #: program): named inputs are then passed in declared order.
    keywords: bool = True
    notes: list[str] = field(default_factory=list)
    #: A Hugging Face directory's tokenizer, when it holds one (Generate's text prompts).
    tokenizer: Any = None


def parse_shape(text: str) -> tuple[int, ...]:
    """Parse ``"-1,3,224,224"`` (or ``x``-separated) into a shape tuple."""
    parts = [p for p in text.replace("x", ",").split(",") if p.strip()]
    try:
        shape = tuple(int(p) for p in parts)
    except ValueError:
        raise ModelLoadError(f"--input-shape {text!r} is not a comma-separated list of ints") from None
    if not shape or any(d < -1 or d == 0 for d in shape):
        raise ModelLoadError(f"--input-shape {text!r}: dims must be positive, or -1 for a free dimension")
    return shape


def _torch_dtype(name: str, flag: str) -> torch.dtype:
    try:
        return DTYPE_BY_NAME[name]
    except KeyError:
        raise ModelLoadError(f"{flag} {name!r}: expected one of {', '.join(DTYPE_BY_NAME)}") from None


def parse_input(text: str) -> InputSpec:
    """Parse ``--input NAME:DTYPE:SHAPE``, e.g. ``input_ids:int64:-1,-1``."""
    parts = text.split(":")
    if len(parts) != 3 or not parts[0].isidentifier():
        raise ModelLoadError(f"--input {text!r}: expected NAME:DTYPE:SHAPE, e.g. input_ids:int64:-1,-1")
    name, dtype, shape = parts
    try:
        dims = parse_shape(shape)
    except ModelLoadError as exc:
        raise ModelLoadError(str(exc).replace("--input-shape", f"--input {name}")) from None
    return InputSpec(name, _torch_dtype(dtype, f"--input {name}"), dims)


def forward_parameters(module: nn.Module) -> tuple[list[str], bool]:
    """``forward``'s parameter names that can take a tensor, and whether it takes ``**kwargs``."""
    try:
        params = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):  # a builtin or scripted forward has no Python signature
        return [], True
    names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return names, any(p.kind is p.VAR_KEYWORD for p in params)


def _declared_inputs(input_shape: str | None, input_dtype: str, what: str,
                     module: nn.Module | None = None, inputs: Sequence[str] = ()) -> list[InputSpec]:
    """``--input`` declarations, or ``--input-shape``/``--input-dtype`` for one input named after ``forward``'s first parameter."""
    names, var_keyword = forward_parameters(module) if module is not None else ([], True)
    if inputs:
        if input_shape is not None:
            raise ModelLoadError("--input declares every input; drop --input-shape (its shorthand for one input)")
        specs = [parse_input(text) for text in inputs]
        seen: set[str] = set()
        for spec in specs:
            if spec.name in seen:
                raise ModelLoadError(f"--input {spec.name!r} is declared twice")
            seen.add(spec.name)
            if names and not var_keyword and spec.name not in names:
                raise ModelLoadError(f"--input {spec.name!r}: {what}'s forward takes no such argument; "
                                     f"it takes {', '.join(names)}")
        return specs
    if input_shape is None:
        raise ModelLoadError(f"{what} needs --input NAME:DTYPE:SHAPE (repeatable) or --input-shape "
                             "(e.g. -1,3,224,224) to declare its inputs")
    return [InputSpec(names[0] if names else "input", _torch_dtype(input_dtype, "--input-dtype"), parse_shape(input_shape))]


#: Keys of each kind a --weights mismatch lists.
LISTED_KEYS = 20


def _key_list(what: str, keys: list[str]) -> str:
    more = f" and {len(keys) - LISTED_KEYS} more" if len(keys) > LISTED_KEYS else ""
    return f"{len(keys)} {what} ({', '.join(keys[:LISTED_KEYS])}{more})"


def _load_weights(module: nn.Module, weights: str) -> None:
    path = Path(weights)
    if not path.is_file():
        raise ModelLoadError(f"--weights {weights!r}: no such file")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - torch raises many types for a bad file
        raise ModelLoadError(f"--weights {weights!r}: cannot load state_dict ({exc.__class__.__name__}: {str(exc).splitlines()[0]})") from None
    if not isinstance(state, dict):
        raise ModelLoadError(f"--weights {weights!r}: expected a state_dict, got {type(state).__name__}")
    # Compared by key first: torch's own error puts the missing keys on a line of their own.
    own = module.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    wrong = [f"{k} {tuple(v.shape)} vs {tuple(own[k].shape)}" for k, v in state.items()
             if k in own and isinstance(v, torch.Tensor) and v.shape != own[k].shape]
    parts = [_key_list(what, keys) for what, keys in
             (("missing", missing), ("unexpected", unexpected), ("of the wrong shape (file vs model)", wrong)) if keys]
    if parts:
        raise ModelLoadError(f"--weights {weights!r} does not fit the model: {'; '.join(parts)}")
    try:
        module.load_state_dict(state)
    except RuntimeError as exc:
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        raise ModelLoadError(f"--weights {weights!r} does not fit the model: {' '.join(lines) or 'mismatch'}") from None


def _load_torchvision(name: str) -> nn.Module | None:
    try:
        import torchvision.models as tvm  # noqa: PLC0415 - optional dependency
    except Exception:  # noqa: BLE001 - a broken torchvision install is "no torchvision"
        return None
    try:
        builder = tvm.get_model_builder(name)
    except ValueError:
        return None
    model: nn.Module = builder(weights=None)
    return model


def _first_parameter(module: nn.Module) -> str:
    names, _ = forward_parameters(module)
    return names[0] if names else "input"


def _export_signature(program: torch.export.ExportedProgram) -> list[InputSpec]:
    """User inputs of an exported program; dynamic dims (SymInts) become -1."""
    user = set(program.graph_signature.user_inputs)
    specs = []
    for node in program.graph.nodes:
        val = node.meta.get("val") if node.op == "placeholder" and node.name in user else None
        if isinstance(val, torch.Tensor):
            shape = tuple(d if isinstance(d, int) else -1 for d in val.shape)
            specs.append(InputSpec(node.name, val.dtype, shape))
    return specs


def _load_export(path: Path, input_shape: str | None, input_dtype: str, inputs: Sequence[str] = ()) -> LoadedModel:
    try:
        program = torch.export.load(str(path))
    except Exception as exc:  # noqa: BLE001 - any failure is a start-up error naming the file
        raise ModelLoadError(f"{path}: not a loadable torch.export program ({exc.__class__.__name__})") from None
    # Module hooks never fire on ExportedProgram.module(); unflatten restores
    # the original module hierarchy, whose submodules do run their hooks.
    module = torch.export.unflatten(program)
    if input_shape is not None or inputs:
        specs = _declared_inputs(input_shape, input_dtype, "a torch.export program", inputs=inputs)
        if input_shape is not None and (placeholders := _export_signature(program)):
            specs = [InputSpec(placeholders[0].name, specs[0].dtype, specs[0].shape)]
    else:
        specs = _export_signature(program)
        if not specs:
            raise ModelLoadError(f"{path}: cannot read the program's input signature; pass --input")
    return LoadedModel(module, path.stem, "export", specs, keywords=False)


def _load_torchscript(path: Path, input_shape: str | None, input_dtype: str, inputs: Sequence[str] = ()) -> LoadedModel:
    try:
        module = torch.jit.load(str(path), map_location="cpu")  # type: ignore[no-untyped-call]  # unannotated in torch
    except Exception as exc:  # noqa: BLE001 - any failure is a start-up error naming the file
        raise ModelLoadError(f"{path}: not a loadable TorchScript file ({exc.__class__.__name__})") from None
    specs = _declared_inputs(input_shape, input_dtype, "a TorchScript model", inputs=inputs)
    note = "TorchScript modules refuse Python hooks: Infer works, Capture and taps do not"
    return LoadedModel(module, path.stem, "torchscript", specs, hooks_supported=False, notes=[note])


def parse_model_args(pairs: list[str] | None) -> dict[str, object]:
    """``--model-arg key=value`` pairs: values are Python literals where they parse, else strings."""
    kwargs: dict[str, object] = {}
    for pair in pairs or []:
        key, sep, text = pair.partition("=")
        if not sep or not key.strip().isidentifier():
            raise ModelLoadError(f"--model-arg {pair!r}: expected key=value with key a Python identifier")
        try:
            value: object = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            value = text
        kwargs[key.strip()] = value
    return kwargs


def _import_factory_module(ref: str, source: str) -> object:
    """``pkg.mod`` from ``sys.path`` (PYTHONPATH), or ``path/to/file.py`` by its path."""
    if source.endswith(".py"):
        path = Path(source)
        if not path.is_file():
            raise ModelLoadError(f"--model {ref!r}: no such file {source!r}")
        spec = importlib.util.spec_from_file_location(f"layertap_factory_{path.stem}", path)
        if spec is None or spec.loader is None:
            raise ModelLoadError(f"--model {ref!r}: cannot import {source!r} as a module")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod  # dataclasses and pickling look their module up there
        try:
            spec.loader.exec_module(mod)
        except Exception as exc:  # noqa: BLE001 - the user's file may raise anything at import
            del sys.modules[spec.name]
            raise ModelLoadError(f"--model {ref!r}: importing {source!r} raised {exc.__class__.__name__}: {exc}") from None
        return mod
    try:
        return importlib.import_module(source)
    except ImportError as exc:
        raise ModelLoadError(f"--model {ref!r}: cannot import {source!r} ({exc}); put the folder that holds it on "
                             f"PYTHONPATH, or pass a file path (path/to/{source.rpartition('.')[2]}.py:factory)") from None


def _load_factory(ref: str, input_shape: str | None, input_dtype: str, kwargs: dict[str, object],
                  inputs: Sequence[str] = ()) -> LoadedModel:
    mod_name, _, attr = ref.rpartition(":")
    mod = _import_factory_module(ref, mod_name)
    factory = getattr(mod, attr, None)
    if not callable(factory):
        raise ModelLoadError(f"--model {ref!r}: {mod_name!r} has no callable {attr!r}")
    try:
        module = factory(**kwargs)
    except Exception as exc:  # noqa: BLE001 - a user factory may raise anything
        raise ModelLoadError(f"--model {ref!r}: factory raised {exc.__class__.__name__}: {exc}") from None
    if not isinstance(module, nn.Module):
        raise ModelLoadError(f"--model {ref!r}: factory returned {type(module).__name__}, not nn.Module")
    specs = _declared_inputs(input_shape, input_dtype, f"factory {ref!r}", module, inputs)
    return LoadedModel(module, attr, "factory", specs)


def vocabulary(module: nn.Module) -> int | None:
    """The number of token ids the model embeds: transformers' ``get_input_embeddings``, else (a
    factory's plain module) its first ``nn.Embedding``; None when it has none.

    The rows, not ``config.vocab_size``: after ``resize_token_embeddings`` only the rows say which ids embed.
    """
    get = getattr(module, "get_input_embeddings", None)
    embeddings = get() if callable(get) else next((m for m in module.modules() if isinstance(m, nn.Embedding)), None)
    return int(embeddings.num_embeddings) if isinstance(embeddings, nn.Embedding) else None


def _load_hf(ref: str, hf_class: str | None, trust_remote_code: bool, kwargs: dict[str, object]) -> LoadedModel:
    try:
        got = hf.load_pretrained(ref, hf_class=hf_class, trust_remote_code=trust_remote_code, kwargs=kwargs)
    except hf.HFLoadError as exc:
        raise ModelLoadError(str(exc)) from None
    (main_name, main_dtype, main_shape), *rest = got.inputs
    vocab = vocabulary(got.module) if main_name == "input_ids" else None
    # Only the main input is positional in every model's forward; the others
    # (attention_mask, token_type_ids) are optional, go by keyword and take the ids' shape.
    specs = [InputSpec(main_name, main_dtype, main_shape, vocab=vocab),
             *(InputSpec(name, dtype, shape, required=False, keyword=True, shape_of=main_name if vocab else None)
               for name, dtype, shape in rest)]
    return LoadedModel(got.module, got.name, "hf", specs, notes=got.notes, tokenizer=got.tokenizer)


def load_model(
    model: str = "demo",
    *,
    seed: int = 0,
    weights: str | None = None,
    input_shape: str | None = None,
    input_dtype: str = "float32",
    inputs: Sequence[str] = (),
    model_args: list[str] | None = None,
    hf_class: str | None = None,
    trust_remote_code: bool = False,
) -> LoadedModel:
    """Resolve ``--model`` into a :class:`LoadedModel` on the CPU in eval mode.

    ``model`` is ``demo``, a torchvision model name, a ``.pt2`` export, a
    TorchScript file (``.pt``/``.ts``/``.jit``), ``package.module:factory``,
    ``path/to/file.py:factory`` or ``hf:DIR`` (a ``save_pretrained`` directory
    or a hub id). ``model_args`` (``key=value``) go to the factory or to
    ``from_pretrained``.
    ``inputs`` are ``--input NAME:DTYPE:SHAPE`` declarations (factories,
    exports, TorchScript); ``input_shape``/``input_dtype`` declare one input.
    """
    path = Path(model)
    kwargs = parse_model_args(model_args)
    if kwargs and not (model.startswith("hf:") or ":" in model):
        raise ModelLoadError(f"--model-arg applies to factories and hf: models, not to --model {model!r}")
    if (hf_class or trust_remote_code) and not model.startswith("hf:"):
        raise ModelLoadError("--hf-class and --trust-remote-code apply to --model hf:DIR only")
    if model.startswith("hf:"):
        loaded = _load_hf(model[3:], hf_class, trust_remote_code, kwargs)
        if weights:
            _load_weights(loaded.module, weights)
    elif model == "demo":
        loaded = LoadedModel(
            build_demo_model(seed), "demo", "demo", [InputSpec("x", torch.float32, DEMO_INPUT_SHAPE)]
        )
        if weights:
            _load_weights(loaded.module, weights)
    elif model.endswith(".pt2"):
        if not path.is_file():
            raise ModelLoadError(f"--model {model!r}: no such file")
        loaded = _load_export(path, input_shape, input_dtype, inputs)
    elif path.suffix in {".pt", ".ts", ".jit", ".pth"} and ":" not in model:
        if not path.is_file():
            raise ModelLoadError(f"--model {model!r}: no such file")
        loaded = _load_torchscript(path, input_shape, input_dtype, inputs)
    elif ":" in model:
        loaded = _load_factory(model, input_shape, input_dtype, kwargs, inputs)
        if weights:
            _load_weights(loaded.module, weights)
    else:
        tv = _load_torchvision(model)
        if tv is None:
            raise ModelLoadError(
                f"--model {model!r}: not 'demo', a .pt2/.pt file, 'package.module:factory', 'hf:DIR', "
                "or a torchvision model name (is torchvision installed?)"
            )
        if weights:
            _load_weights(tv, weights)
        shape = parse_shape(input_shape) if input_shape else (-1, 3, 224, 224)
        loaded = LoadedModel(tv, model, "torchvision", [InputSpec(_first_parameter(tv), torch.float32, shape)])
    loaded.module.eval()
    return loaded
