"""The model input a CLI command sends: ``--input`` files, or ``--random-input`` made from the metadata.

``layertap infer`` and ``layertap capture --random-input`` share this module,
so both send the same input for the same metadata. A random input fits
``client.metadata().inputs``:

* every required input gets an array of its dtype and shape; optional ones
  (an ``attention_mask`` the model defaults) are left out;
* a free dimension (-1) is the batch (1) when it comes first, else a
  sequence or spatial length (8);
* floating inputs are standard normal float32 (the server casts them to the
  model's float dtype); an integer or bool input whose name holds ``mask``
  is all ones; other integers are token ids drawn from ``0..vocab_size-1``.
  The metadata names no vocabulary, so the caller gives its size
  (``--vocab-size``, default 100; ``layertap serve``'s hint says the served
  model's).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .._types import TensorSpec
from .args import positive_int

__all__ = [
    "DEFAULT_VOCAB_SIZE",
    "FREE_BATCH",
    "FREE_LENGTH",
    "add_vocab_flag",
    "load_input",
    "random_inputs",
]

Array = np.ndarray[Any, Any]

#: Token ids are drawn below this unless ``--vocab-size`` says otherwise.
DEFAULT_VOCAB_SIZE = 100
#: The size a free leading dimension (the batch) gets.
FREE_BATCH = 1
#: The size any other free dimension (a sequence) gets.
FREE_LENGTH = 8


def load_input(path: Path) -> list[Array] | dict[str, Array]:
    """A .npy is one input; a .npz's keys are input names (``np.savez(f, input_ids=..., attention_mask=...)``),
    except numpy's own ``arr_0``, ``arr_1``... of unnamed arrays, which stay positional."""
    loaded = np.load(path, allow_pickle=False)
    if isinstance(loaded, np.lib.npyio.NpzFile):
        with loaded:
            if all(key == f"arr_{i}" for i, key in enumerate(loaded.files)):
                return [loaded[key] for key in loaded.files]
            return {key: loaded[key] for key in loaded.files}
    return [np.asarray(loaded)]


def _shape(spec: TensorSpec) -> tuple[int, ...]:
    return tuple((FREE_BATCH if i == 0 else FREE_LENGTH) if d == -1 else int(d) for i, d in enumerate(spec.shape))


def random_inputs(
    specs: Sequence[TensorSpec], *, vocab_size: int = DEFAULT_VOCAB_SIZE, seed: int | None = None
) -> dict[str, Array]:
    """A random array per required input of ``specs``, by name (see the module docstring)."""
    rng = np.random.default_rng(seed)
    out: dict[str, Array] = {}
    for spec in specs:
        if spec.optional:
            continue
        shape = _shape(spec)
        if spec.dtype.startswith(("float", "bfloat")):
            out[spec.name] = rng.standard_normal(shape).astype(np.float32)
        elif spec.dtype == "bool":
            out[spec.name] = np.ones(shape, dtype=np.bool_)
        elif "mask" in spec.name:
            out[spec.name] = np.ones(shape, dtype=np.dtype(spec.dtype))
        else:
            out[spec.name] = rng.integers(0, vocab_size, size=shape).astype(np.dtype(spec.dtype))
    return out


def add_vocab_flag(p: argparse.ArgumentParser) -> None:
    """``--vocab-size``: the range of a random input's token ids."""
    p.add_argument(
        "--vocab-size", type=positive_int, default=DEFAULT_VOCAB_SIZE, metavar="N",
        help="random token ids are drawn from 0..N-1 (default %(default)s: the metadata gives no vocabulary "
             "size, so pass the model's if it is smaller); masks are all ones, free dims are batch "
             f"{FREE_BATCH} and length {FREE_LENGTH}, optional inputs are left out",
    )
