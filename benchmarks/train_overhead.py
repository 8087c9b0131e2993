"""Training-step overhead of an attached agent: gradient taps vs none, side by side.

In process: the real agent (``layertap.attach``) and the real client. Each
round runs every variant once, interleaved, on its own copy of the demo model
(same weights, same batches); a measurement is the median of ``--steps``
timed training steps (forward, backward, ``optimizer.step()``). Ratios are
variant / ``base`` of the same round; the script prints the median ratio and
its spread over rounds.

Variants:
  base      no agent
  attached  agent attached (step hooks), no taps
  grad      param_grad norm on every top-level layer ("*", the total-norm
            recipe) + grad_output norm on the block-level modules, streamed
            to a client thread that reads everything
  stalled   the same taps streamed to a subscriber that never reads
            (queue_size=1): the step must not slow down; drops are counted
"""

from __future__ import annotations

import argparse
import copy
import platform
import statistics
import threading
import time
from collections.abc import Iterator

import torch
from torch import nn

import layertap
from layertap.server.host.demo_model import build_demo_model

GRAD_OUTPUT = "re:layer[1-4]|layer[1-4]\\.[0-9]+|avgpool|fc"


def batches(batch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    while True:
        yield torch.randn(batch, 3, 32, 32, generator=gen), torch.randint(0, 10, (batch,), generator=gen)


def step_times(model: nn.Module, opt: torch.optim.Optimizer, data: Iterator[tuple[torch.Tensor, torch.Tensor]],
               steps: int) -> float:
    """Median seconds of one training step over ``steps`` steps (after one warm-up step)."""
    times = []
    for i in range(steps + 1):
        x, y = next(data)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


class Variant:
    def __init__(self, name: str, base: nn.Module, agent: bool, compile_reducers: bool = False) -> None:
        self.name = name
        self.model = copy.deepcopy(base).train()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        self.agent = (layertap.attach(self.model, self.opt, metrics_port=0, compile_reducers=compile_reducers)
                      if agent else None)
        self.client = layertap.Client(self.agent.address) if self.agent else None


def run_round(v: Variant, data: Iterator[tuple[torch.Tensor, torch.Tensor]], steps: int,
              taps: str) -> tuple[float, int, int]:
    """Seconds per step, summaries read, and messages dropped in this measurement."""
    if taps == "none":
        return step_times(v.model, v.opt, data, steps), 0, 0
    assert v.client is not None and v.agent is not None
    reading = taps == "read"
    queue = 10_000 if reading else 1
    streams = [v.client.watch("*", point="param_grad", reducers="norm", queue_size=queue),
               v.client.watch(GRAD_OUTPUT, point="grad_output", reducers="norm", queue_size=queue)]
    for s in streams:
        next(s.batches())  # the taps exist
    read = [0]
    readers = []
    if reading:
        def drain(s: layertap.SummaryStream) -> None:
            try:
                for _ in s:
                    read[0] += 1
            except layertap.LayertapError:
                pass

        readers = [threading.Thread(target=drain, args=(s,), daemon=True) for s in streams]
        for t in readers:
            t.start()
    broker = v.agent.server.state.broker
    dropped0 = broker.dropped_total
    seconds = step_times(v.model, v.opt, data, steps)
    v.agent.server.state.taps.flush(10)
    time.sleep(0.2)
    dropped = broker.dropped_total - dropped0
    for s in streams:
        s.close()
    for t in readers:
        t.join(5)
    return seconds, read[0], dropped


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--compile", action="store_true",
                   help="agents attach with compile_reducers=True (the kernel is process-wide, so compare two runs)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    base = build_demo_model(0)
    plan: list[tuple[str, bool, str]] = [("base", False, "none"), ("attached", True, "none"),
                                         ("grad", True, "read"), ("stalled", True, "stall")]
    variants = {name: Variant(name, base, agent, args.compile) for name, agent, _ in plan}
    data = {name: batches(args.batch) for name in variants}
    ratios: dict[str, list[float]] = {name: [] for name, _, _ in plan[1:]}
    bases: list[float] = []
    notes: dict[str, tuple[int, int]] = {}
    try:
        for _ in range(args.repeats):
            times: dict[str, float] = {}
            for name, _agent, taps in plan:
                seconds, read, dropped = run_round(variants[name], data[name], args.steps, taps)
                times[name] = seconds
                r0, d0 = notes.get(name, (0, 0))
                notes[name] = (r0 + read, d0 + dropped)
            bases.append(times["base"])
            for name in ratios:
                ratios[name].append(times[name] / times["base"])
    finally:
        for v in variants.values():
            if v.client is not None:
                v.client.close()
            if v.agent is not None:
                v.agent.close()
    print(f"# {platform.node()} {platform.machine()} torch {torch.__version__} threads={args.threads} "
          f"batch={args.batch} steps={args.steps} repeats={args.repeats} compile={args.compile}")
    print(f"base step: median {1e3 * statistics.median(bases):.1f} ms")
    print(f"{'variant':10s} {'ratio':>7s} {'min..max':>13s} {'read':>8s} {'dropped':>8s}")
    for name, rs in ratios.items():
        read, dropped = notes[name]
        print(f"{name:10s} {statistics.median(rs):7.3f} {min(rs):6.3f}..{max(rs):6.3f} {read:8d} {dropped:8d}")


if __name__ == "__main__":
    main()
