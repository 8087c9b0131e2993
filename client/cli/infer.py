"""``layertap infer``: send model inputs and summarise what comes back, the traffic a fresh server lacks."""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .args import CommandFactory, connect, positive_int
from .input import add_vocab_flag, load_input, random_inputs
from .json_lines import write_json_lines

__all__ = ["InferSummary", "OutputSummary", "add_infer_command", "summarize"]


@dataclass(frozen=True)
class OutputSummary:
    """One output of a call: its name (a key, ``outputN`` for a tuple position, ``output`` for a lone tensor)."""

    name: str
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class InferSummary:
    """One ``infer`` call, as ``--json`` writes it."""

    call: int
    latency_ms: float
    outputs: list[OutputSummary]
    #: Outputs the server did not send (a KV cache, ``None``): ``name (type)``.
    skipped: list[str]


def summarize(call: int, latency_s: float, result: Any) -> InferSummary:
    """Names, dtypes and shapes of what ``Client.infer`` returned."""
    if isinstance(result, dict):
        items: list[tuple[str, Any]] = list(result.items())
    elif isinstance(result, list):
        items = [(f"output{i}", value) for i, value in enumerate(result)]
    else:
        items = [("output", result)]
    outputs = [OutputSummary(name, str(value.dtype), tuple(int(d) for d in value.shape))
               for name, value in items if value is not None]
    skipped = [f"{s.name} ({s.type})" for s in getattr(result, "skipped", ())]
    return InferSummary(call, round(latency_s * 1000, 3), outputs, skipped)


def _line(summary: InferSummary) -> str:
    parts = [f"{o.name} {o.dtype} {o.shape}" for o in summary.outputs]
    parts += [f"{s} skipped" for s in summary.skipped]
    return f"call {summary.call}: {summary.latency_ms:.1f} ms  " + ", ".join(parts)


def _cmd_infer(args: argparse.Namespace) -> int:
    with connect(args) as client:
        positional: list[Any] = []
        named: dict[str, Any] = {}
        if args.input is not None:
            loaded = load_input(args.input)
            if isinstance(loaded, list):
                positional = loaded
            else:
                named = loaded
        else:
            named = random_inputs(client.metadata().inputs, vocab_size=args.vocab_size)
            described = ", ".join(f"{k} {v.dtype} {v.shape}" for k, v in named.items())
            print(f"random input: {described}", file=sys.stderr)
        for call in range(1, args.repeat + 1):
            start = time.perf_counter()
            result = client.infer(*positional, **named)
            summary = summarize(call, time.perf_counter() - start, result)
            if args.json:
                write_json_lines([summary])
            else:
                print(_line(summary), flush=True)
    return 0


def add_infer_command(command: CommandFactory) -> None:
    """Register ``infer`` with the CLI's ``command(name, help)`` factory (which adds HOST and the connection flags)."""
    p = command("infer", "Run the model on a random input that fits its metadata (or on --input) and summarise "
                         "each call's outputs and latency.")
    p.add_argument("--input", type=Path,
                   help="send this .npy (one input) or .npz (keys name the inputs) instead of a random input")
    p.add_argument("--repeat", type=positive_int, default=1, metavar="N", help="calls to make (default 1)")
    add_vocab_flag(p)
    p.add_argument("--json", action="store_true", help="one JSON object per call, with the fields of InferSummary")
    p.set_defaults(func=_cmd_infer)

