"""One rank of a 2-process gloo DDP run with an agent attached; prints a JSON result.

Run by tests/e2e/test_train_ddp.py with RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT set, as torchrun would.
"""

from __future__ import annotations

import itertools
import json
import math

import torch
import torch.distributed as dist
from torch import nn

import layertap
from layertap.server.host.demo_model import build_demo_model

STEPS = 3


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = build_demo_model(0).train()
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data: local grads differ
    clipped, local = [], []
    with layertap.attach(ddp, opt, metrics_port=None) as agent, layertap.Client(agent.address) as client:
        names = [layer.name for layer in client.layers()]
        stream = client.watch("*", point="param_grad", reducers="norm", queue_size=10_000, timeout=120)
        next(stream.batches())
        dist.barrier()
        for _ in range(STEPS):
            x, y = torch.randn(4, 3, 32, 32, generator=gen), torch.randint(0, 10, (4,), generator=gen)
            opt.zero_grad()
            loss = nn.functional.cross_entropy(ddp(x), y)
            # The local gradient, before DDP's all-reduce averages it.
            local_grads = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
            local.append(float(torch.linalg.vector_norm(torch.stack([g.double().norm() for g in local_grads]))))
            loss.backward()
            clipped.append(float(nn.utils.clip_grad_norm_(ddp.parameters(), max_norm=math.inf)))
            opt.step()
        n = len(list(model.parameters()))
        totals: dict[int, float] = {}
        for s in itertools.islice(stream, STEPS * n):
            totals[s.step] = totals.get(s.step, 0.0) + s.results["norm"].l2 ** 2
        stream.close()
        source = client.metadata().source
    dist.destroy_process_group()
    print(json.dumps({"rank": rank, "port": agent.port, "source": source, "names": names[:3],
                      "clipped": clipped, "local": local,
                      "totals": [math.sqrt(totals[k]) for k in sorted(totals)], "steps": sorted(totals)}))


if __name__ == "__main__":
    main()
