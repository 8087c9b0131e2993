"""One rank of a 2-process gloo DDP run with an agent attached; prints a JSON result.

Run by tests/e2e/test_train_ddp.py with RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT set, as torchrun would. ``LT_MODEL=inplace``
trains the in-place-ReLU model of support.training instead of the demo
model, with gradient taps on the layers whose outputs the ReLUs overwrite.
"""

from __future__ import annotations

import itertools
import json
import math
import os

import torch
import torch.distributed as dist
from torch import nn

import layertap
from layertap.server.host.demo_model import build_demo_model
from support.training import inplace_net

STEPS = 3


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    inplace = os.environ.get("LT_MODEL") == "inplace"
    model = (inplace_net(0) if inplace else build_demo_model(0)).train()
    shape = (3, 8, 8) if inplace else (3, 32, 32)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data: local grads differ
    clipped, local = [], []
    with layertap.attach(ddp, opt, metrics_port=None) as agent, layertap.Client(agent.address) as client:
        names = [layer.name for layer in client.layers()]
        stream = client.watch("*", point="param_grad", reducers="norm", queue_size=10_000, timeout=120)
        next(stream.batches())
        # The outputs ReLU(inplace=True) overwrites: full backward hooks here would raise in the forward.
        grads = {p: client.watch("re:conv1|bn1|conv2", point=p, reducers="norm,nonfinite", queue_size=10_000,
                                 timeout=120) for p in ("grad_output", "grad_input")} if inplace else {}
        for s in grads.values():
            next(s.batches())
        dist.barrier()
        for _ in range(STEPS):
            x, y = torch.randn(4, *shape, generator=gen), torch.randint(0, 10, (4,), generator=gen)
            opt.zero_grad()
            loss = nn.functional.cross_entropy(ddp(x), y)
            if not inplace:  # a second backward would fire the gradient taps twice
                # The local gradient, before DDP's all-reduce averages it.
                local_grads = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
                local.append(float(torch.linalg.vector_norm(torch.stack([g.double().norm() for g in local_grads]))))
            loss.backward()
            clipped.append(float(nn.utils.clip_grad_norm_(ddp.parameters(), max_norm=math.inf)))
            opt.step()
        tap_errors = sum(t.errors for t in client.taps())
        n = len(list(model.parameters()))
        totals: dict[int, float] = {}
        for s in itertools.islice(stream, STEPS * n):
            totals[s.step] = totals.get(s.step, 0.0) + s.results["norm"].l2 ** 2
        stream.close()
        # conv1's input is the data, which needs no gradient: it has no grad_input.
        seen = {p: sorted((x.step, x.layer) for x in itertools.islice(s, STEPS * (3 if p == "grad_output" else 2))
                          if x.results["norm"].l2 > 0 and x.results["nonfinite"].nan_count == 0)
                for p, s in grads.items()}
        for s in grads.values():
            s.close()
        source = client.metadata().source
    dist.destroy_process_group()
    print(json.dumps({"rank": rank, "port": agent.port, "source": source, "names": names[:3],
                      "clipped": clipped, "local": local, "seen": seen, "tap_errors": tap_errors,
                      "hook_errors": agent.host.hooks.errors,
                      "totals": [math.sqrt(totals[k]) for k in sorted(totals)], "steps": sorted(totals)}))


if __name__ == "__main__":
    main()
