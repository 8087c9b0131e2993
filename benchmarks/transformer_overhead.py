"""Transformer tap overhead: Infer latency with a basic tap on every decoder layer, against two peers, one run.

A random-init Llama-architecture model (``LlamaConfig``: 4 layers, hidden
256, no download), batch 8 x 128 tokens with an attention mask. Every row
taps the 4 decoder layers (``model.layers.*``) with the same basic
statistics as ``overhead.py``'s variants (a) and (b): mean, std, min, max,
zero fraction, NaN and Inf counts. Rows, each against its own untapped run,
interleaved (A B A B ...) in every round:

  layertap  the real serving path: ``layertap serve --model hf:DIR`` (a
            subprocess, so client and server do not share a GIL) on the
            ``save_pretrained`` directory; ``client.infer(input_ids=...,
            attention_mask=...)`` with and without a durable tap
            (``create_tap("model.layers.*", reducers=moments, minmax,
            zero_fraction, nonfinite)``). The base includes gRPC and the
            logits' encode/decode, which a tap does not change.
  seed      ``.item()`` forward hooks on the same layers (overhead.py's (a)),
            in process on the local model, against its hook-free forward.
  nnsight   ``with model.trace(...)`` computing and ``.save()``-ing the same
            statistics per layer, against nnsight's empty trace and the plain
            forward. It runs in ``--nnsight-python``'s interpreter (nnsight
            lives in its own venv), as a worker this script drives round by
            round; without that flag the row is skipped with a note.

Each cell is the median of ``--requests`` timed calls; a row's ratio is the
median over rounds of tapped / base, with its spread [min..max]. Because the
three rows have different bases (Infer over gRPC vs a local forward), the
added milliseconds per call are printed too: they compare the taps' own cost.
A second column gives CPU time per call of the process running the forward
(the server's, from /proc, for layertap), for machines shared with other load.

    python benchmarks/transformer_overhead.py --rounds 11 --requests 10 \\
        --nnsight-python /tmp/nnsight-venv/bin/python
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
from collections.abc import Callable
from typing import Any

import torch
from _serving import (
    BASIC,
    SELECTOR,
    Cell,
    Peer,
    answer_rounds,
    load_model,
    median_ms,
    metric,
    process_cpu,
    save_llama,
    settle_compiles,
    start_server,
    timed,
)
from torch import nn

CONFIG = {"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4, "num_attention_heads": 4,
          "num_key_value_heads": 4, "vocab_size": 8192, "max_position_embeddings": 512}


def make_inputs(batch: int, tokens: int, padded: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and a mask with a little left padding on half the rows, as a padded batch has
    (``padded=False``: every position valid)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, CONFIG["vocab_size"], (batch, tokens), generator=g)
    mask = torch.ones(batch, tokens, dtype=torch.long)
    if padded:
        mask[::2, : tokens // 8] = 0
    return ids, mask


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    return list(model.model.layers)  # type: ignore[union-attr, arg-type]


def seed_style_hooks(model: nn.Module) -> Callable[[], None]:
    """overhead.py's (a): one ``.item()`` per statistic, per decoder layer."""
    sink: list[float] = []

    def hook(_m: nn.Module, _a: object, out: torch.Tensor | tuple[torch.Tensor, ...]) -> None:
        x = (out[0] if isinstance(out, tuple) else out).float()
        sink.extend([x.mean().item(), x.std().item(), x.min().item(), x.max().item(),
                     (x == 0).float().mean().item(), torch.isnan(x).sum().item(), torch.isinf(x).sum().item()])

    handles = [layer.register_forward_hook(hook) for layer in decoder_layers(model)]

    def remove() -> None:
        for h in handles:
            h.remove()
    return remove


def nnsight_worker(directory: str, batch: int, tokens: int) -> None:
    """Runs under ``--nnsight-python``: one JSON line of medians per ``n`` read on stdin."""
    import nnsight  # only in the nnsight venv
    raw = load_model(directory)
    model = nnsight.NNsight(raw)
    ids, mask = make_inputs(batch, tokens)
    n_layers = len(model.model.layers)

    def plain() -> None:
        with torch.inference_mode():
            raw(input_ids=ids, attention_mask=mask)

    def empty() -> None:
        with torch.inference_mode(), model.trace(input_ids=ids, attention_mask=mask):
            pass

    def stats() -> list[object]:
        saved = []
        with torch.inference_mode(), model.trace(input_ids=ids, attention_mask=mask):
            for i in range(n_layers):
                out = model.model.layers[i].output  # a Tensor in transformers 5 (no (hidden,) tuple)
                x = (out[0] if isinstance(out, tuple) else out).float()
                saved.append(torch.stack([x.mean(), x.std(), x.min(), x.max(), (x == 0).float().mean(),
                                          torch.isnan(x).sum().float(), torch.isinf(x).sum().float()]).save())  # type: ignore[attr-defined]
        return saved

    got = stats()
    assert len(got) == n_layers and all(torch.isfinite(torch.as_tensor(s)).all() for s in got)
    for call in (plain, empty, stats):
        median_ms(call, 3)

    def one_round(line: str) -> dict[str, Cell]:
        n = int(line)
        return {"plain": timed(plain, n), "empty": timed(empty, n), "stats": timed(stats, n), "plain2": timed(plain, n)}
    answer_rounds({"version": nnsight.__version__}, one_round)


class NnsightPeer(Peer):
    """Drives ``nnsight_worker`` in another interpreter, one round per call."""

    def __init__(self, python: str, directory: str, batch: int, tokens: int) -> None:
        super().__init__([python, __file__, "--nnsight-worker", directory, "--batch", str(batch), "--tokens", str(tokens)])
        self.version = str(self.hello["version"])

    def round(self, n: int) -> dict[str, Cell]:
        return {k: (float(v[0]), float(v[1])) for k, v in self.ask(str(n)).items()}




def hook_seconds(metrics_port: int) -> tuple[float, float]:
    """The server's hook time so far: (seconds, passes), all taps together."""
    return (metric(metrics_port, "layertap_hook_duration_seconds_sum"),
            metric(metrics_port, "layertap_hook_duration_seconds_count"))


#: The layertap rows: (label, mask with padding, keep_padding); --masks and --keep-padding-row pick them.
VARIANTS = {
    "padded": ("layertap tap, Infer over gRPC (vs untapped Infer)", True, None),
    "full": ("layertap tap, mask without padding", False, None),
    "keep": ("layertap tap keep_padding=True, padded mask", True, True),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--requests", type=int, default=15, help="timed calls per cell")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--masks", default="padded",
                    help="layertap rows by the mask Infer sends: 'padded' (1/8 left padding on half the rows), "
                         "'full' (no padding), or both comma-separated (default padded)")
    ap.add_argument("--keep-padding-row", action="store_true",
                    help="add a row whose tap keeps the padded positions (TapSpec.keep_padding)")
    ap.add_argument("--no-seed", action="store_true", help="skip the in-process seed-hooks row")
    ap.add_argument("--nnsight-python", help="an interpreter with nnsight installed (else the nnsight row is skipped)")
    ap.add_argument("--nnsight-worker", metavar="DIR", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.nnsight_worker:
        nnsight_worker(args.nnsight_worker, args.batch, args.tokens)
        return
    variants = [m.strip() for m in args.masks.split(",") if m.strip()]
    if any(v not in ("padded", "full") for v in variants):
        ap.error(f"--masks: padded, full or both, got {args.masks!r}")
    if args.keep_padding_row:
        variants.append("keep")

    import numpy as np
    import transformers

    import layertap

    with tempfile.TemporaryDirectory(prefix="layertap-llama-") as directory:
        save_llama(directory, CONFIG)
        model = load_model(directory)
        ids, mask = make_inputs(args.batch, args.tokens)
        masks = {True: mask.numpy(), False: make_inputs(args.batch, args.tokens, padded=False)[1].numpy()}
        ids_np = ids.numpy()
        peer = NnsightPeer(args.nnsight_python, directory, args.batch, args.tokens) if args.nnsight_python else None
        proc, address, metrics_port = start_server(directory)
        cells: dict[str, list[tuple[Cell, Cell]]] = {**{v: [] for v in variants}, "seed": [], "nnsight": [],
                                                     "nnsight empty": []}
        hook_ms: dict[str, list[float]] = {v: [] for v in variants}
        try:
            with layertap.Client(address, timeout=120) as client:
                def infer(padded: bool = True) -> Any:
                    return client.infer(input_ids=ids_np, attention_mask=masks[padded])

                def forward() -> object:
                    with torch.inference_mode():
                        return model(input_ids=ids, attention_mask=mask)

                local = forward().logits  # type: ignore[attr-defined]
                served = np.asarray(infer()["logits"])
                assert np.allclose(served, local.numpy(), atol=1e-4), "served logits differ from the local model"
                median_ms(infer, 5)
                tap = client.create_tap(SELECTOR, reducers=BASIC, forever=True)  # first sighting: compiles
                layers = client.stats().active_hooks
                median_ms(infer, 5)
                last = settle_compiles(metrics_port)  # no new compile for 5 s
                client.delete_tap(tap)
                median_ms(forward, 3)
                server_cpu = process_cpu(proc.pid)
                for _ in range(args.rounds):
                    for v in variants:
                        _label, padded, keep = VARIANTS[v]
                        base = timed(lambda p=padded: infer(p), args.requests, server_cpu)
                        options = {"keep_padding": keep} if keep is not None else {}
                        tap = client.create_tap(SELECTOR, reducers=BASIC, forever=True, **options)
                        median_ms(lambda p=padded: infer(p), 2)
                        h0 = hook_seconds(metrics_port)
                        tapped = timed(lambda p=padded: infer(p), args.requests, server_cpu)
                        h1 = hook_seconds(metrics_port)
                        client.delete_tap(tap)
                        cells[v].append((base, tapped))
                        hook_ms[v].append((h1[0] - h0[0]) * 1e3 / max(h1[1] - h0[1], 1.0))
                    if not args.no_seed:
                        base = timed(forward, args.requests)
                        remove = seed_style_hooks(model)
                        try:
                            hooked = timed(forward, args.requests)
                        finally:
                            remove()
                        cells["seed"].append((base, hooked))
                    if peer is not None:
                        r = peer.round(args.requests)
                        # the plain forward ran before and after the traces
                        plain = ((r["plain"][0] + r["plain2"][0]) / 2, (r["plain"][1] + r["plain2"][1]) / 2)
                        cells["nnsight"].append((plain, r["stats"]))
                        cells["nnsight empty"].append((plain, r["empty"]))
        finally:
            proc.terminate()
            proc.wait(30)
            if peer is not None:
                peer.close()

    print(f"Llama {CONFIG}, batch {args.batch} x {args.tokens} tokens (padded mask: 1/8 left padding on half the rows)")
    print(f"{platform.machine()}, torch {torch.__version__}, transformers {transformers.__version__}, "
          f"nnsight {peer.version if peer else '-'}; {layers} hooks per tap, compiled kernels {last:.0f}; "
          f"{args.rounds} interleaved rounds x {args.requests} calls")
    print("wall: median latency per call; CPU: CPU time per call of the process doing the forward "
          "(the server for layertap), less disturbed by the shared cores' other load; hooks: the server's "
          "hook and reducer time per pass (layertap_hook_duration_seconds), median [min..max] over rounds")
    print(f"{'row':50s} {'base ms':>8s} {'added':>8s} {'ratio':>6s}  {'spread':12s} | "
          f"{'CPU ms':>7s} {'added':>7s} {'ratio':>6s}  {'spread':12s} | hooks ms/pass")
    labels = {**{v: VARIANTS[v][0] for v in variants},
              "seed": "seed .item() hooks (vs local forward)",
              "nnsight": "nnsight trace + .save() stats (vs forward)",
              "nnsight empty": "nnsight empty trace (vs forward)"}
    for key, pairs in cells.items():
        if not pairs:
            why = "--no-seed" if key == "seed" else "pass --nnsight-python /path/to/venv/bin/python"
            print(f"{labels[key]:50s} skipped: {why}")
            continue
        line = f"{labels[key]:50s}"
        for i in (0, 1):  # wall, then CPU
            ratios = [t[i] / b[i] for b, t in pairs]
            base_ms = statistics.median(b[i] for b, _ in pairs)
            added = statistics.median(t[i] - b[i] for b, t in pairs)
            line += (f" {base_ms:8.1f} {added:+8.1f} {statistics.median(ratios):5.2f}x  "
                     f"{f'[{min(ratios):.2f}..{max(ratios):.2f}]':12s}" + " |")
        if key in hook_ms:
            h = hook_ms[key]
            line += f" {statistics.median(h):.2f} [{min(h):.2f}..{max(h):.2f}]"
        print(line)


if __name__ == "__main__":
    main()
