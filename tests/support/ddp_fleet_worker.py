"""One rank of a 2-process gloo DDP run that trains until told to stop, for a Fleet client.

Run by tests/e2e/test_train_fleet.py with RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT set, as torchrun would, plus LT_PORT and
LT_METRICS_PORT (base ports: this rank adds LOCAL_RANK) and LT_DIR, where
the test creates ``go`` (start training) and ``stop``. The ranks agree on
stopping through an all-reduce, so both run the same steps. Prints a JSON
result: ``clip_grad_norm_`` and the fc weight's gradient norm of each step.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import layertap
from layertap.server.host.demo_model import build_demo_model


def main() -> None:
    control = Path(os.environ["LT_DIR"])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = build_demo_model(0).train()
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data: local grads differ
    clipped: dict[int, float] = {}
    fc: dict[int, float] = {}
    with layertap.attach(ddp, opt, port=int(os.environ["LT_PORT"]),
                         metrics_port=int(os.environ["LT_METRICS_PORT"])) as agent:
        while not (control / "go").exists():
            time.sleep(0.05)
        step = 0
        while True:
            stop = torch.tensor([float((control / "stop").exists())])
            dist.all_reduce(stop, op=dist.ReduceOp.MAX)
            if stop.item():
                break
            x, y = torch.randn(4, 3, 32, 32, generator=gen), torch.randint(0, 10, (4,), generator=gen)
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            clipped[step] = float(nn.utils.clip_grad_norm_(ddp.parameters(), max_norm=math.inf))
            assert model.fc.weight.grad is not None
            fc[step] = float(model.fc.weight.grad.double().norm())
            opt.step()
            step += 1
            time.sleep(0.05)  # two ranks share two cores with the test and its clients
        result = {"rank": rank, "port": agent.port, "metrics_port": agent.metrics_port, "steps": step,
                  "clipped": clipped, "fc": fc, "hook_errors": agent.host.hooks.errors,
                  "step_errors": agent.steps.errors}
    dist.destroy_process_group()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
