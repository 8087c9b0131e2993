"""``layertap generate``: tokens from the served causal LM as they come, and the layers behind each.

One prompt's tokens stream inline: the text pieces when the model directory
holds a tokenizer, else the ids. Several prompts (``--ids`` more than once)
or ``--watch`` give one line per token instead, and ``--watch SELECTOR``
adds, per pass, a line with the mean of each matched layer's output (an
inline ``moments`` tap that sees only this request's rows)::

    pos 17 decode  model.layers.0 0.0123  model.layers.1 -0.0456

``--json`` writes one object per line, each with a ``kind``: ``token``,
``layers`` (a ``--watch`` line) and, last, ``result``. A plain run ends with
one line of counts, time to first token, time per output token and finish
reasons.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from .._generate import GeneratedToken, GenerationResult, GenerationStep, Prompt
from .._types import Summary, TapSpec
from .args import PROG, CommandFactory, connect, non_negative_int, positive_float, positive_int
from .json_lines import jsonable, write_json_lines

__all__ = ["LayersLine", "TokenLine", "add_generate_command", "layers_lines", "result_line"]

#: The reducer behind ``--watch``: a layer's mean is all it prints.
WATCH_REDUCERS = ("moments",)


@dataclass(frozen=True)
class TokenLine:
    """One generated token, as ``--json`` writes it."""

    phase: str
    step: int
    sequence: int
    id: int
    position: int
    logprob: float
    text: str
    kind: str = "token"


@dataclass(frozen=True)
class LayersLine:
    """One pass's layer means under ``--watch``, as ``--json`` writes it (``position`` None: rows differ)."""

    phase: str
    position: int | None
    pass_index: int
    means: dict[str, float]
    kind: str = "layers"


def _id_list(text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.replace(" ", ",").split(",") if part]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("expected at least one token id")
    return ids


def _layer_name(s: Summary) -> str:
    name = f"{s.layer}[{s.output_index}]" if s.output_index else s.layer
    return f"{name}#{s.call_index}" if s.call_index else name


def layers_lines(summaries: list[Summary]) -> list[LayersLine]:
    """The ``--watch`` lines of a step's summaries: one per pass, each layer's ``moments`` mean in arrival order."""
    by_pass: dict[int, LayersLine] = {}
    for s in summaries:
        moments = s.results.get("moments")
        if moments is None:
            continue  # an unsampled pass: only the always-on NaN/Inf counter ran
        line = by_pass.setdefault(s.pass_index, LayersLine(s.phase, s.position, s.pass_index, {}))
        line.means[_layer_name(s)] = float(getattr(moments, "mean"))
    return list(by_pass.values())


def _position(position: int | None) -> str:
    return "pos -" if position is None else f"pos {position}"


def _layers_text(line: LayersLine) -> str:
    means = "  ".join(f"{name} {mean:.4g}" for name, mean in line.means.items())
    return f"{_position(line.position)} {line.phase}  {means}"


def _token_text(token: GeneratedToken, phase: str, several: bool) -> str:
    seq = f"seq {token.sequence} " if several else ""
    piece = f"  {token.text!r}" if token.text else ""
    return f"{seq}pos {token.position} {phase}  id {token.id}{piece}  logprob {token.logprob:.4f}"


def result_line(result: GenerationResult) -> str:
    """The last line of a plain run: counts, latency, and why each sequence stopped."""
    parts = [f"{result.generated_tokens} tokens generated from {result.prompt_tokens} prompt tokens",
             f"time to first token {result.time_to_first_token * 1e3:.1f} ms",
             f"{result.time_per_output_token * 1e3:.2f} ms per output token",
             f"finish: {', '.join(result.finish_reasons)}"]
    if result.dropped:
        parts.append(f"{result.dropped} summaries dropped")
    return "; ".join(parts)


class _Printer:
    """Writes each step as it arrives, in the run's mode (inline, lines or JSON)."""

    def __init__(self, args: argparse.Namespace, sequences: int) -> None:
        self._json = bool(args.json)
        self._several = sequences > 1
        self._inline = not (self._json or self._several or args.watch)
        self._written = 0
        self._texts = False

    def step(self, step: GenerationStep) -> None:
        layers = layers_lines(step.summaries)
        if self._json:
            write_json_lines([*(TokenLine(step.phase, step.step, t.sequence, t.id, t.position, t.logprob, t.text)
                                for t in step.tokens), *layers])
        elif self._inline:
            for t in step.tokens:
                # A run with text prints only text: a special token's empty piece is not its id.
                self._texts = self._texts or bool(t.text)
                sys.stdout.write(t.text if self._texts else f"{' ' if self._written else ''}{t.id}")
                self._written += 1
            sys.stdout.flush()
        else:
            for line in layers:
                print(_layers_text(line))
            for t in step.tokens:
                print(_token_text(t, step.phase, self._several))
            sys.stdout.flush()

    def finish(self, result: GenerationResult) -> None:
        if self._json:
            write_json_lines([{"kind": "result", **jsonable(result)}])
            return
        if self._inline:
            print()
        print(result_line(result), flush=True)


def _prompt(args: argparse.Namespace) -> Prompt | None:
    if args.ids and args.text is not None:
        return None
    if args.ids:
        ids: list[list[int]] = args.ids
        return ids[0] if len(ids) == 1 else ids
    text: str | None = args.text
    return text


def _cmd_generate(args: argparse.Namespace) -> int:
    prompt = _prompt(args)
    if prompt is None:
        print(f"{PROG}: generate: give the prompt as TEXT or as --ids ID,ID,... (repeatable), not both",
              file=sys.stderr)
        return 2
    sampling = any(v is not None for v in (args.temperature, args.top_k, args.top_p, args.seed))
    taps = [TapSpec(selector, reducers=WATCH_REDUCERS) for selector in args.watch]
    with connect(args) as client, \
            client.generate(prompt, max_new_tokens=args.max_new_tokens, do_sample=args.sample or sampling,
                            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                            stop_token_ids=args.stop, taps=taps, timeout=args.timeout) as generation:
        printer = _Printer(args, len(generation.prompts))
        for step in generation:
            printer.step(step)
        printer.finish(generation.result())
    return 0


def add_generate_command(command: CommandFactory) -> None:
    """Register ``generate`` with the CLI's ``command(name, help)`` factory (which adds HOST and the connection flags)."""
    p = command("generate", "Generate tokens with the served causal LM from a text (or --ids) and print them as they "
                            "come; --watch adds each pass's layer means. --timeout bounds the whole generation.")
    p.add_argument("text", nargs="?", metavar="TEXT", help="the prompt as text (the model directory needs a tokenizer)")
    p.add_argument("--ids", action="append", type=_id_list, metavar="ID,ID,...",
                   help="a prompt as token ids; repeat for several sequences (lengths may differ)")
    p.add_argument("--max-new-tokens", type=positive_int, default=16, metavar="N",
                   help="new tokens per sequence (default %(default)s; the server caps it)")
    p.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=positive_float, metavar="T", help="softmax temperature (implies --sample)")
    p.add_argument("--top-k", type=positive_int, metavar="K", help="keep the K most likely tokens (implies --sample)")
    p.add_argument("--top-p", type=positive_float, metavar="P",
                   help="keep the smallest set of tokens whose probability reaches P, in (0, 1] (implies --sample)")
    p.add_argument("--seed", type=non_negative_int, help="the request's own sampling seed: the same seed, the same tokens (implies --sample)")
    p.add_argument("--stop", action="append", type=int, default=[], metavar="ID",
                   help="a token id that ends a sequence, besides the model's end-of-sequence ids (repeatable)")
    p.add_argument("--watch", action="append", default=[], metavar="SELECTOR",
                   help="print each pass's mean of these layers' outputs (module name, glob or re:regex; repeatable)")
    p.add_argument("--json", action="store_true",
                   help="one JSON object per line: kind token, layers (--watch) and a final result")
    p.set_defaults(func=_cmd_generate)
