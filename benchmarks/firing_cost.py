"""Host cost per tap firing, through the real server (issue 42's figure).

Model: a 32-block MLP of width 1024 at batch 1, each block ``Linear`` +
``ReLU`` + residual. Its 128 MB of weights stream through the caches on every
pass, as a decode step's do, while each tapped tensor is only 1,024 floats, so
the tap's cost is nearly all host work per firing.

Tap: one durable basic tap (``moments``, ``minmax``, ``nonfinite``) on every
block's ``Linear`` (32 firings a pass). Rounds alternate a batch of Infer calls
without the tap and a batch with it; each round gives (median latency with -
median without) / 32, and the figure is the median over rounds. ``layertap
serve`` runs as a subprocess, so client and server do not share a GIL; the
basic tap fires as one ``layertap::tap_stats`` call (issue 42), so no
statistics kernel compiles; ``--plan-path`` serves it as before the op (the
reducer plan in the hook, the compiled kernel), for a side-by-side figure.

    python benchmarks/firing_cost.py --rounds 9 --requests 60
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from _serving import serve  # benchmarks/ is on sys.path when run as a script

import layertap

BASIC = ["moments", "minmax", "nonfinite"]
SELECTOR = r"re:^blocks\.\d+\.linear$"

_FACTORY = '''
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(x))


class MLP(nn.Module):
    def __init__(self, width: int, blocks: int) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(Block(width) for _ in range(blocks)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x) / {blocks}


def make() -> nn.Module:
    torch.manual_seed(0)
    return MLP({width}, {blocks})
'''


def median_latency(client: layertap.Client, x: np.ndarray, n: int) -> float:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        client.infer(x)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def one_round(client: layertap.Client, x: np.ndarray, requests: int, blocks: int) -> tuple[float, float]:
    """(base median latency, per-firing cost) of one round: a batch without the tap, then one with it."""
    base = median_latency(client, x, requests)
    tap = client.create_tap(SELECTOR, reducers=BASIC)
    for _ in range(3):
        client.infer(x)
    tapped = median_latency(client, x, requests)
    client.delete_tap(tap.id)
    return base, (tapped - base) / blocks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--blocks", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--requests", type=int, default=60, help="Infer calls per half-round")
    ap.add_argument("--no-compile", action="store_true", help="eager statistics kernels (the plan path's)")
    ap.add_argument("--op-only", action="store_true", help="skip the plan-path server")
    args = ap.parse_args()

    paths = {"op": [], "plan path (--no-tap-op)": ["--no-tap-op"]}
    if args.op_only:
        del paths["plan path (--no-tap-op)"]
    with tempfile.TemporaryDirectory() as tmp:
        factory = Path(tmp) / "firing_mlp.py"
        factory.write_text(_FACTORY.replace("{width}", str(args.width)).replace("{blocks}", str(args.blocks)))
        flags = ["--model", f"{factory}:make", f"--input-shape=-1,{args.width}", "--metrics-port", "0"]
        flags += ["--no-compile"] if args.no_compile else []
        # Both servers run side by side (one idles while the other is timed); rounds alternate between them.
        servers = {name: serve([*flags, *extra]) for name, extra in paths.items()}
        clients: dict[str, layertap.Client] = {}
        try:
            x = np.random.default_rng(0).standard_normal((1, args.width), dtype=np.float32)
            for name, (_proc, address, _port) in servers.items():
                client = clients[name] = layertap.Client(address, timeout=60)
                for _ in range(10):
                    client.infer(x)  # warm-up
                tap = client.create_tap(SELECTOR, reducers=BASIC)
                assert len(tap.layers) == args.blocks, tap.layers
                client.delete_tap(tap.id)
            per_firing: dict[str, list[float]] = {name: [] for name in servers}
            bases: dict[str, list[float]] = {name: [] for name in servers}
            for r in range(args.rounds):
                for name, client in clients.items():
                    base, cost = one_round(client, x, args.requests, args.blocks)
                    bases[name].append(base)
                    per_firing[name].append(cost)
                    print(f"round {r} {name}: base {base * 1e3:.2f} ms, per firing {cost * 1e6:.1f} us", flush=True)
        finally:
            for client in clients.values():
                client.close()
            for proc, _address, _port in servers.values():
                proc.terminate()
                proc.wait(30)
    print(f"\nmachine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}; width {args.width}, {args.blocks} blocks, batch 1, {args.rounds} rounds")
    for name in servers:
        costs = per_firing[name]
        print(f"{name:26s} base Infer {statistics.median(bases[name]) * 1e3:.2f} ms; per firing median "
              f"{statistics.median(costs) * 1e6:.1f} us [{min(costs) * 1e6:.1f} .. {max(costs) * 1e6:.1f}]")
    print("(issue 42's target on this CPU: <= 20 us a firing)")


if __name__ == "__main__":
    main()
