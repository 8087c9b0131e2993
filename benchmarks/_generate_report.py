"""The record of one generation in ``generate.py`` and the tables it prints from them."""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Run:
    """One generation: wall s, tokens, first-token and per-step s, CPU s of the forward's process and the client."""

    wall: float
    tokens: int
    ttft: float
    tpot: float
    cpu: float
    client_cpu: float = 0.0
    server_ttft: float = 0.0
    server_tpot: float = 0.0
    summaries: int = 0
    dropped: int = 0
    ids: tuple[int, ...] = ()

    @property
    def rate(self) -> float:
        return self.tokens / self.wall


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), platform.machine())
    except OSError:
        return platform.processor() or platform.machine()


def spread(values: Sequence[float], fmt: str = "{:.1f}", unit: str = "") -> str:
    """``median [min..max]``; "-" for none."""
    if not values:
        return "-"
    return f"{fmt.format(statistics.median(values))}{unit} [{fmt.format(min(values))}..{fmt.format(max(values))}]"


def report(args: argparse.Namespace, config: dict[str, Any], runs: dict[str, list[Run]],
           many: list[tuple[float, list[Run]]], *, compiled: float, agree: int, check: Run | None, refused: str,
           versions: dict[str, str], nnsight_threads: int | None) -> None:
    n = args.new
    print(f"Llama: {config['num_hidden_layers']} layers, hidden {config['hidden_size']}, intermediate "
          f"{config['intermediate_size']}, {config['num_attention_heads']} heads, vocabulary {config['vocab_size']}; "
          f"prompt {args.prompt} tokens, {n} new tokens, greedy, batch 1")
    print(f"{cpu_model()}, {os.cpu_count()} cores, device {args.device}; torch {torch.__version__} "
          f"({args.threads} threads per process{'' if nnsight_threads in (None, args.threads) else f', nnsight worker {nnsight_threads}'}), "
          f"transformers {versions['transformers']}, grpcio {versions['grpcio']}, nnsight {versions['nnsight']}")
    layers = config["num_hidden_layers"]
    on_layers = f"{layers} layer{'s' if layers != 1 else ''}"
    tap_line = (f"inline tap: {check.summaries} summaries per call (layers x steps = {layers * n}), {check.dropped} "
                "dropped" if check is not None else f"inline tap refused by the server ({refused})")
    print(f"{args.rounds} interleaved rounds; served tokens equal to model.generate's for {agree}/{n}; {tap_line}; "
          f"reducer kernels compiled {compiled:.0f}")
    print()
    labels = {"local": "model.generate, in process",
              "bare": "bare loop (forward + argmax), in process",
              "served": "Generate, no taps",
              "inline": f"Generate + inline basic tap on {on_layers}",
              "durable": "Generate + durable tap (CreateTap), none inline",
              "nn plain": "nnsight venv: model.generate",
              "nn empty": "nnsight generate, empty trace",
              "nn stats": "nnsight generate + per-layer stats every step"}
    base = {"served": ("local", "model.generate", "0.90x"), "inline": ("served", "Generate, no taps", "0.90x"),
            "durable": ("served", "Generate, no taps", "0.90x"), "bare": ("local", "model.generate", ""),
            "nn empty": ("nn plain", "nnsight venv: model.generate", ""),
            "nn stats": ("nn plain", "nnsight venv: model.generate", "")}
    print("wall: tokens/s over the call's wall time; CPU: CPU ms per token of the process that runs the forward "
          "(the server's for Generate),\nwhich the shared cores' other load disturbs less; ratio: per round, "
          "the row's tokens/s (or tokens per CPU second) over its base's; median [min..max]")
    print(f"{'row':48s} {'wall tokens/s':>20s}   {'against':28s} {'wall ratio':>18s} | "
          f"{'CPU ms/token':>18s} {'CPU ratio':>18s}  target")
    for key, label in labels.items():
        if not runs[key]:
            why = f"the server refused the inline tap ({refused})" if key == "inline" else \
                "pass --nnsight-python /path/to/venv/bin/python"
            print(f"{label:48s} skipped: {why}")
            continue
        line = f"{label:48s} {spread([r.rate for r in runs[key]]):>20s}"
        cpu = f"{spread([r.cpu / r.tokens * 1e3 for r in runs[key]], '{:.2f}'):>18s}"
        if key in base:
            other, name, target = base[key]
            ratios = [a.rate / b.rate for a, b in zip(runs[key], runs[other])]
            # /proc counts CPU in ticks (10 ms): a tiny smoke-test call may read 0
            cpu_ratios = [(b.cpu / b.tokens) / (a.cpu / a.tokens) for a, b in zip(runs[key], runs[other]) if a.cpu and b.cpu]
            line += (f"   {name:28s} {spread(ratios, '{:.2f}', 'x'):>18s} | {cpu} "
                     f"{spread(cpu_ratios, '{:.2f}', 'x'):>18s}  {'>= ' + target if target else ''}")
        else:
            line += f"   {'':28s} {'':>18s} | {cpu}"
        print(line)

    print()
    print(f"{'concurrent clients (same shape each)':48s} {'aggregate tokens/s':>20s}   {'per-client tokens/s':>20s}")
    print(f"{'1 (the Generate, no taps row)':48s} {spread([r.rate for r in runs['served']]):>20s}   "
          f"{spread([r.rate for r in runs['served']]):>20s}")
    print(f"{args.clients:<48d} {spread([a for a, _ in many]):>20s}   "
          f"{spread([r.rate for _, rs in many for r in rs]):>20s}")

    print()
    print("where the time goes (ms, medians over rounds): TTFT = call to first token; TPOT = mean time per later "
          "token;\nCPU/token: CPU time of the process that runs the forward (the server's for Generate), and of the client")

    def ms(values: Sequence[float]) -> str:
        return f"{statistics.median(values) * 1e3:.2f}"

    print(f"{'':48s} {'TTFT':>8s} {'TPOT':>8s} {'wall/token':>10s} {'CPU/token':>10s} {'client CPU':>10s}")
    table = [("bare loop, in process", "bare", False), ("model.generate, in process (streamer clock)", "local", False),
             ("Generate, no taps: client (messages received)", "served", False),
             ("Generate, no taps: server (GenerationFinished)", "served", True),
             ("Generate + inline tap: client", "inline", False), ("Generate + inline tap: server", "inline", True),
             ("Generate + durable tap: client", "durable", False), ("Generate + durable tap: server", "durable", True)]
    for label, key, server in table:
        rs = runs[key]
        if not rs:
            print(f"{label:48s} skipped")
            continue
        ttft = [r.server_ttft if server else r.ttft for r in rs]
        tpot = [r.server_tpot if server else r.tpot for r in rs]
        tail = (f" {ms([r.wall / r.tokens for r in rs]):>10s} {ms([r.cpu / r.tokens for r in rs]):>10s} "
                f"{ms([r.client_cpu / r.tokens for r in rs]) if key in ('served', 'inline', 'durable') else '-':>10s}"
                if not server else "")
        print(f"{label:48s} {ms(ttft):>8s} {ms(tpot):>8s}{tail}")

    def per_round(f: Callable[[Run, Run], float], a: str, b: str) -> list[float]:
        return [f(x, y) * 1e3 for x, y in zip(runs[a], runs[b])]

    def cpu_per_token(a: str, b: str) -> list[float]:
        return per_round(lambda x, y: x.cpu / x.tokens - y.cpu / y.tokens, a, b)

    print("differences, per round, median [min..max] ms:       per decode step (TPOT)     CPU per token")
    for label, a, b, server in [("model.generate's loop over the bare forward", "local", "bare", False),
                                ("the server's step over model.generate's", "served", "local", False),
                                (f"inline tap on {on_layers} over no taps (server)", "inline", "served", True),
                                (f"durable tap on {on_layers} over no taps (server)", "durable", "served", True)]:
        tpot = per_round((lambda x, y: x.server_tpot - y.server_tpot) if server else
                         (lambda x, y: (x.server_tpot if a == "served" else x.tpot) - y.tpot), a, b)
        print(f"  {label:50s} {spread(tpot, '{:+.2f}'):>24s} {spread(cpu_per_token(a, b), '{:+.2f}'):>24s}")
    # The client's wall time past the server's own span (arrival to last token): the request's way in,
    # the last token's and the finished message's way out, and the stream's end.
    edges = [(r.wall - (r.server_ttft + (r.tokens - 1) * r.server_tpot)) * 1e3 for r in runs["served"]]
    print(f"gRPC: the client's wall time past the server's span {spread(edges, '{:.1f}')} ms per call "
          f"({statistics.median(edges) / n:.3f} ms per token); client CPU per token "
          f"{spread([r.client_cpu / r.tokens * 1e3 for r in runs['served']], '{:.2f}')} ms")
    if agree != n:
        print(f"note: the served tokens left model.generate's at token {agree}: a random-init model's top-2 logits "
              "can be within float noise", file=sys.stderr)
