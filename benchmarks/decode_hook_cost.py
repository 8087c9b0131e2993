"""Where a tap's cost goes at batch-1 decode: model-thread CPU per step, in process, paired round by round.

The Generate benchmark (``generate.py``) shows a basic tap on 8 decoder layers costing 1.5-2.6 ms of
server CPU per decode step, while the engine alone (8 hooks fired on 512-float tensors outside a
model) costs about 0.35 ms. This script finds the rest: the issue-24 Llama (8 layers, hidden 512) on
a ``ModelHost`` with a ``TapEngine``, one 64-token prefill then ``--steps`` decode passes per run, the
rows below alternating round by round (order reversed every other round). Each cell is the median
over rounds of the row's per-step CPU, and its paired difference against ``base`` in the same round
(median [quartiles]): slow drifts of the shared VM cancel in the pairs.

  base            no hooks
  raw no-op hooks a bare ``register_forward_hook(lambda m, a, o: None)`` on the 8 layers
  hook, no work   the tap's hooks through layertap's registry, its callback a no-op
  tap             the basic tap (moments, minmax, zero_fraction, nonfinite), as served
  tap, no publish the same, the publisher's work skipped (the host-transfer thread idles)
  tap, per tensor the tap with small tensors reduced one by one in their hooks, as before
                  ``reducers.batched`` (each hook copies its tensor; the pass's end reduces the copies)

Columns: model-thread CPU (``time.thread_time``), process CPU (every thread), the hook's own
time as the engine measures it (``on_hook_time``): inside the forward the same hook code runs ~3x
its cost outside (the model's code and data evict it from the caches), and the model runs slower
after it; the host-transfer thread's CPU (its own CPU clock, where the OS has one), and the model thread's time
off the CPU during the decode steps (wall minus its CPU): mostly waiting for the GIL, which the
host-transfer thread's Python holds, so the two track each other.

    python benchmarks/decode_hook_cost.py --rounds 20
"""

from __future__ import annotations

import argparse
import math
import platform
import random
import statistics
import tempfile
import time
from collections.abc import Callable

import numpy as np
import torch
from _serving import BASIC, SELECTOR, save_llama

from layertap.server.app import process_compilation
from layertap.server.host.model_host import PHASE_DECODE, PHASE_PREFILL, ModelHost, RequestRows
from layertap.server.host.sources import load_model
from layertap.server.stream.broker import Broker
from layertap.server.taps.engine import TapEngine
from layertap.server.taps.plan_path import PlanPath
from layertap.server.taps.tap_files import reducer_spec
from layertap.v1 import telemetry_pb2 as pb

#: The process's compiled statistics kernel and pass registry, as a server gets them from app.py.
SHARED = process_compilation()
STATS = SHARED.stats

CONFIG = {"hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 8, "num_attention_heads": 8,
          "num_key_value_heads": 8, "vocab_size": 8192, "max_position_embeddings": 256, "eos_token_id": None,
          "bos_token_id": None, "pad_token_id": None}


#: Per decode step: model-thread, process, hook, host-transfer thread and model off-CPU milliseconds.
Cells = tuple[float, float, float, float, float]


class Rig:
    """The model host, the engine, and one tap made and deleted as the rows need it."""

    def __init__(self, steps: int) -> None:
        directory = tempfile.mkdtemp()
        save_llama(directory, CONFIG)
        self.host = ModelHost(load_model(f"hf:{directory}"), passes=SHARED.passes)
        self.engine = TapEngine(self.host, Broker(), rng=random.Random(0), stats=STATS)
        self.hook_seconds = 0.0
        self.engine.sinks.on_hook_time = self._hook_time  # type: ignore[method-assign]
        self.steps = steps
        self.spec = pb.TapSpec(selector=SELECTOR, reducers=[reducer_spec(k, "r") for k in BASIC])

    def _hook_time(self, seconds: float) -> None:
        self.hook_seconds += seconds

    def run(self) -> Cells:
        """(model-thread ms, process ms, hook ms, host-transfer ms, model off-CPU ms) per decode step
        of one prefill and ``steps`` decodes."""
        model, host = self.host.module, self.host
        ids = torch.arange(1, 65)[None]
        mask = torch.ones_like(ids)
        with host.pass_context(phase=PHASE_PREFILL, requests=(RequestRows("r", slice(0, 1), (64,), 0),), tokens=64), \
                torch.inference_mode():
            out = model(input_ids=ids, attention_mask=mask, use_cache=True, logits_to_keep=1)
        cache, last = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        self.engine.flush()
        self.hook_seconds = 0.0
        x0 = self._transfer_cpu()
        t0, p0, w0 = time.thread_time(), time.process_time(), time.perf_counter()
        for s in range(self.steps):
            mask = torch.cat([mask, torch.ones((1, 1), dtype=mask.dtype)], 1)
            with host.pass_context(phase=PHASE_DECODE, requests=(RequestRows("r", slice(0, 1), (64 + s,), 0),),
                                   tokens=1), torch.inference_mode():
                out = model(input_ids=last, attention_mask=mask, position_ids=mask.sum(-1, keepdim=True) - 1,
                            cache=cache, use_cache=True, logits_to_keep=1)
            last = out.logits[:, -1].argmax(-1, keepdim=True)
        wall, model = time.perf_counter() - w0, time.thread_time() - t0
        self.engine.flush()
        n = self.steps
        return (model * 1e3 / n, (time.process_time() - p0) * 1e3 / n, self.hook_seconds * 1e3 / n,
                (self._transfer_cpu() - x0) * 1e3 / n, (wall - model) * 1e3 / n)

    def _transfer_cpu(self) -> float:
        """The host-transfer thread's CPU seconds so far, from its own CPU clock (NaN where there is none)."""
        ident = self.engine.transfer._thread.ident
        if ident is None or not hasattr(time, "pthread_getcpuclockid"):
            return math.nan
        return time.clock_gettime(time.pthread_getcpuclockid(ident))

    def with_tap(self, before: Callable[[], object] = lambda: None, after: Callable[[], object] = lambda: None
                 ) -> Cells:
        before()  # first: the tap's hooks bind the engine's callback when the tap is made
        tap = self.engine.create(self.spec, forever=True)
        try:
            return self.run()
        finally:
            self.engine.delete(tap.id)
            after()

    def raw_hooks(self) -> Cells:
        handles = [self.host.module.get_submodule(f"model.layers.{i}").register_forward_hook(lambda m, a, o: None)
                   for i in range(int(CONFIG["num_hidden_layers"] or 0))]
        try:
            return self.run()
        finally:
            for h in handles:
                h.remove()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--steps", type=int, default=32, help="decode passes per run")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the issue's runs use 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    STATS.set_enabled(True)  # as `layertap serve` runs the reducers
    rig = Rig(args.steps)
    engine = rig.engine
    publish = engine.publisher.publish
    real_hook = PlanPath.fire

    def no_work() -> None:
        PlanPath.fire = lambda *a, **k: None  # type: ignore[method-assign, assignment]

    def real_work() -> None:
        PlanPath.fire = real_hook  # type: ignore[method-assign]

    def no_publish() -> None:
        engine.publisher.publish = lambda *a, **k: None  # type: ignore[method-assign]

    def publish_again() -> None:
        engine.publisher.publish = publish  # type: ignore[method-assign]

    def per_tensor() -> None:
        engine.plans.batch_small = False

    def batched() -> None:
        engine.plans.batch_small = True

    rows: dict[str, Callable[[], Cells]] = {
        "base": rig.run,
        "raw no-op hooks": rig.raw_hooks,
        "hook, no work": lambda: rig.with_tap(no_work, real_work),
        "tap": rig.with_tap,
        "tap, no publish": lambda: rig.with_tap(no_publish, publish_again),
        "tap, per tensor": lambda: rig.with_tap(per_tensor, batched),
    }
    for row in rows.values():  # warm-up, and the reducers' kernel compiled before timing
        row()
    STATS.wait_idle(300)
    cells: dict[str, list[Cells]] = {k: [] for k in rows}
    for r in range(args.rounds):
        for name in (list(rows) if r % 2 == 0 else list(rows)[::-1]):
            cells[name].append(rows[name]())
    print(f"Llama 8 layers, hidden 512, batch-1 decode, {args.steps} steps per run, {args.rounds} rounds; "
          f"{platform.machine()}, torch {torch.__version__}, {args.threads} torch thread(s)")
    print(f"{'row':18s} {'model-thread ms':>16s} {'vs base (paired)':>28s} {'process ms':>11s} "
          f"{'vs base (paired)':>28s} {'hook ms':>8s} {'transfer ms':>12s} {'model off-CPU ms':>17s}")
    base = np.array(cells["base"])
    for name, got in cells.items():
        a = np.array(got)
        d = a - base

        def paired(col: int, d: np.ndarray = d) -> str:
            q1, q2, q3 = np.percentile(d[:, col], [25, 50, 75])
            return f"{q2:+.2f} [{q1:+.2f}..{q3:+.2f}]"
        print(f"{name:18s} {statistics.median(a[:, 0]):16.2f} {paired(0):>28s} {statistics.median(a[:, 1]):11.2f} "
              f"{paired(1):>28s} {statistics.median(a[:, 2]):8.2f} {statistics.median(a[:, 3]):12.2f} "
              f"{statistics.median(a[:, 4]):17.2f}")


if __name__ == "__main__":
    main()
