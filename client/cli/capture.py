"""``layertap capture``: the tensors at one or more layers, written to .npy or .npz.

The layers come from live traffic, or from a pass the command runs itself on
``--input`` or ``--random-input`` (:mod:`layertap.cli.input`). One tensor is
an .npy; several (patterns, several layers, ``--n`` passes) an .npz keyed by
``layer`` or ``passN/layer``. Large captures show a progress bar on stderr.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console

from .args import CommandFactory, connect, positive_int
from .input import add_vocab_flag, load_input, random_inputs
from .view import CaptureProgress

__all__ = ["add_capture_command"]


def _flatten(value: Any, prefix: str, out: dict[str, np.ndarray[Any, Any]]) -> None:
    if isinstance(value, dict):
        for key, item in value.items():
            _flatten(item, f"{prefix}/{key}" if prefix else str(key), out)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _flatten(item, f"{prefix}/{index}", out)
    else:
        out[prefix] = np.asarray(value)


def _cmd_capture(args: argparse.Namespace) -> int:
    stderr = Console(stderr=True)
    inputs = load_input(args.input) if args.input is not None else None
    progress = CaptureProgress(stderr)
    try:
        with connect(args) as client:
            if args.random_input:
                inputs = random_inputs(client.metadata().inputs, vocab_size=args.vocab_size)
            result = client.capture(
                list(args.layers),
                input=inputs if isinstance(inputs, dict) else tuple(inputs) if inputs is not None else None,
                n=args.n,
                point=args.point,
                max_batch=args.max_batch,
                dtype=args.dtype,
                timeout=args.timeout,
                progress=progress,
            )
    finally:
        progress.close()
    arrays: dict[str, np.ndarray[Any, Any]] = {}
    if args.n == 1:
        _flatten(result, "", arrays)
    else:
        for index, per_pass in enumerate(result):
            _flatten(per_pass, f"pass{index}", arrays)
    out: Path = args.output
    if len(arrays) == 1 and out.suffix != ".npz":
        ((name, array),) = arrays.items()
        if out.suffix != ".npy":
            out = out.with_name(out.name + ".npy")
        np.save(out, array)
    else:
        if out.suffix != ".npz":
            out = out.with_suffix(".npz")
            stderr.print(f"{len(arrays)} tensors: writing {out} instead of a single .npy")
        np.savez(out, **arrays)  # type: ignore[arg-type]
    for name, array in arrays.items():
        stderr.print(f"{name}: {array.dtype} {tuple(array.shape)}")
    print(out)
    return 0


def add_capture_command(command: CommandFactory) -> None:
    """Register ``capture`` with the CLI's ``command(name, help)`` factory (which adds HOST and the connection flags)."""
    p = command("capture", "Capture the tensors at one or more layers into .npy/.npz.")
    p.add_argument("layers", nargs="+", metavar="LAYER",
                   help="module name(s), globs ('layer*') or re:regex; several or a pattern give an .npz keyed by layer")
    p.add_argument("-o", "--output", required=True, type=Path, help="output .npy or .npz file")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--input", type=Path, help="run this .npy (or multi-argument .npz, whose keys name the inputs) input instead of waiting for live traffic")
    source.add_argument("--random-input", action="store_true",
                        help="run a random input that fits the model's metadata instead of waiting for live traffic "
                             "(works on a fresh server; see 'layertap infer --help')")
    add_vocab_flag(p)
    p.add_argument("--n", type=positive_int, default=1, help="live passes to capture (default 1)")
    p.add_argument("--point", choices=("output", "input"), default="output")
    p.add_argument("--max-batch", type=positive_int, help="keep at most this many batch rows")
    p.add_argument("--dtype", choices=("float16", "bfloat16"), help="downcast floating tensors on the server")
    p.set_defaults(func=_cmd_capture)
