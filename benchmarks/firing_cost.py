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
statistics kernel compiles once before timing (``--no-compile``: eager).

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
from _serving import metric, serve  # benchmarks/ is on sys.path when run as a script

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


def wait_compiled(client: layertap.Client, x: np.ndarray, metrics_port: int, timeout: float = 600) -> None:
    """Passes until the kernel compiled for the tapped tensors serves them (the compile counter settles)."""
    end = time.monotonic() + timeout
    last, still = -1.0, 0
    while time.monotonic() < end and still < 3:
        client.infer(x)
        now = metric(metrics_port, "layertap_reducer_compiles_total")
        still = still + 1 if now == last and now > 0 else 0
        last = now
        time.sleep(0.5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--blocks", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--requests", type=int, default=60, help="Infer calls per half-round")
    ap.add_argument("--no-compile", action="store_true", help="eager statistics kernels")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        factory = Path(tmp) / "firing_mlp.py"
        factory.write_text(_FACTORY.replace("{width}", str(args.width)).replace("{blocks}", str(args.blocks)))
        flags = ["--model", f"{factory}:make", f"--input-shape=-1,{args.width}", "--metrics-port", "0"]
        proc, address, metrics_port = serve([*flags, *(["--no-compile"] if args.no_compile else [])])
        try:
            x = np.random.default_rng(0).standard_normal((1, args.width), dtype=np.float32)
            with layertap.Client(address, timeout=60) as client:
                for _ in range(10):
                    client.infer(x)  # warm-up
                tap = client.create_tap(SELECTOR, reducers=BASIC)
                assert len(tap.layers) == args.blocks, tap.layers
                if not args.no_compile and metrics_port is not None:
                    wait_compiled(client, x, metrics_port)
                client.delete_tap(tap.id)
                per_firing, bases = [], []
                for r in range(args.rounds):
                    base = median_latency(client, x, args.requests)
                    tap = client.create_tap(SELECTOR, reducers=BASIC)
                    for _ in range(3):
                        client.infer(x)
                    tapped = median_latency(client, x, args.requests)
                    client.delete_tap(tap.id)
                    per_firing.append((tapped - base) / args.blocks)
                    bases.append(base)
                    print(f"round {r}: base {base * 1e3:.2f} ms, tapped {tapped * 1e3:.2f} ms, "
                          f"per firing {per_firing[-1] * 1e6:.1f} us", flush=True)
        finally:
            proc.terminate()
            proc.wait(30)
    print(f"\nmachine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}; width {args.width}, {args.blocks} blocks, batch 1")
    print(f"base Infer median {statistics.median(bases) * 1e3:.2f} ms")
    print(f"per firing: median {statistics.median(per_firing) * 1e6:.1f} us "
          f"[{min(per_firing) * 1e6:.1f} .. {max(per_firing) * 1e6:.1f}] over {args.rounds} rounds "
          f"(issue 42's target on this CPU: <= 20 us)")


if __name__ == "__main__":
    main()
