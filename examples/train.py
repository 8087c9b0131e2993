"""Train the demo model on synthetic data with a layertap agent attached.

    python examples/train.py --steps 200 --port 50061
    layertap watch 127.0.0.1:50061 '*' --point param_grad --reducers norm   # in another shell

Random initial weights and random data: nothing is downloaded. Each rank of
a ``torchrun`` job gets its own agent on ``--port`` + LOCAL_RANK.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

import layertap
from layertap.server.host.demo_model import DEMO_NUM_CLASSES, DemoResNet


def synthetic_batches(batch: int, seed: int):  # type: ignore[no-untyped-def]
    """Images whose class shifts their mean, so the loss can actually fall."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        y = torch.randint(0, DEMO_NUM_CLASSES, (batch,), generator=gen)
        x = torch.randn(batch, 3, 32, 32, generator=gen) + 0.3 * y.view(-1, 1, 1, 1).float()
        yield x, y


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--port", type=int, default=0, help="gRPC base port (0: any free port)")
    p.add_argument("--metrics-port", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    torch.manual_seed(args.seed)
    model = DemoResNet()  # random init
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = synthetic_batches(args.batch, args.seed)
    with layertap.attach(model, opt, port=args.port, metrics_port=args.metrics_port) as agent:
        print(f"layertap agent on {agent.address}, metrics on :{agent.metrics_port}", flush=True)
        start = time.perf_counter()
        for step in range(args.steps):
            x, y = next(data)
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()  # the agent's step hooks end the step here
            if step % 10 == 0 or step == args.steps - 1:
                print(f"step {step:4d} loss {loss.item():.4f}", flush=True)
        per_step = (time.perf_counter() - start) / max(1, args.steps)
        print(f"done: {args.steps} steps, {1e3 * per_step:.1f} ms/step, final loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
