"""What leaving padding out costs one tapped tensor, in thread CPU time (robust to other load on shared cores).

One decoder output of ``transformer_overhead.py``'s model, ``(8, 128, 256)``
float32, and its basic reducers (moments, minmax, zero_fraction, nonfinite),
with that benchmark's padded mask (1/8 left padding on half the rows: 960 of
1024 positions valid). Rows, interleaved in blocks, each the CPU time of one
call on one intra-op thread:

  whole              ``plan.run(t)``: what a tap that keeps padding (or a pass
                     without padding) pays
  padding left out   ``plan.run(cut(t))``: the gather and the reduction of the
                     ``(960, 256)`` tensor
  index_select       the gather alone
  host, per pass     ``PassPadding(mask).cut()``: the valid indices, once per pass

for the eager kernel and for the compiled (AOTInductor) one the server runs.

``--passes N`` then measures whole passes in process: ``ModelHost`` and
``TapEngine`` on that model (saved and loaded as ``hf:DIR``), the tap on its 4
decoder layers, the engine's hook timer read as thread CPU time, for the
padded mask with padding left out, the same with ``keep_padding``, and a mask
without padding; N interleaved rounds of 3 passes each, and the untapped
forward's CPU time for scale. Needs transformers.

    python benchmarks/padding_overhead.py --calls 200 --blocks 5 --passes 6
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
import types
from collections.abc import Callable

import torch

from layertap.server.app import process_compilation
from layertap.server.compile.kernel import DENSE, Signature
from layertap.server.host.padding import PassPadding
from layertap.server.host.sources import load_model
from layertap.server.reducers.plan import ReducerPlan, build_reducers
from layertap.server.reducers.spec import parse_reducer_names

#: The process's compiled statistics kernel and pass registry, as a server gets them from app.py.
SHARED = process_compilation()
STATS = SHARED.stats

BASIC = "moments,minmax,zero_fraction,nonfinite"


def cpu_us(call: Callable[[], object], n: int) -> list[float]:
    out = []
    for _ in range(n):
        c = time.thread_time_ns()
        call()
        out.append((time.thread_time_ns() - c) / 1e3)
    return out


def per_pass(rounds: int) -> None:
    import transformer_overhead as bench  # beside this script: its model, inputs and reducers

    import layertap.server.taps.engine as engine_module
    from layertap.server.host.model_host import ModelHost
    from layertap.server.stream.broker import Broker
    from layertap.server.stream.sinks import Sink, Sinks
    from layertap.server.taps.engine import TapEngine
    from layertap.v1 import telemetry_pb2 as pb

    class HookTime(Sink):
        def __init__(self) -> None:
            self.seconds: list[float] = []

        def on_hook_time(self, seconds: float) -> None:
            self.seconds.append(seconds)

    # The engine times its hooks with perf_counter (wall); here, the model thread's CPU time instead.
    engine_module.time = types.SimpleNamespace(  # type: ignore[assignment]
        perf_counter=time.thread_time, monotonic=time.monotonic, time=time.time)
    with tempfile.TemporaryDirectory(prefix="layertap-llama-") as directory:
        bench.make_model(directory)
        host = ModelHost(load_model(f"hf:{directory}"), passes=SHARED.passes)
    hooks, sinks = HookTime(), Sinks()
    sinks.add(hooks)
    engine = TapEngine(host, Broker(), rng=random.Random(0), sinks=sinks, stats=STATS)
    ids, padded = bench.make_inputs(8, 128)
    variants = {"padded, left out": (padded, False), "padded, keep_padding": (padded, True),
                "no padding": (torch.ones_like(padded), False)}

    def run(mask: torch.Tensor) -> None:
        host.run([("input_ids", ids), ("attention_mask", mask)])

    def tap(keep: bool) -> str:
        spec = pb.TapSpec(selector=bench.SELECTOR, keep_padding=keep, reducers=parse_reducer_names(BASIC))
        return engine.create(spec, forever=True).id

    first = tap(False)
    while STATS.counters()["compiled_calls"] < 8:
        run(padded)
        time.sleep(1)
    engine.delete(first)
    forward = []
    for _ in range(3):
        with host.pass_lock():  # held: the pass runs inline, on this thread, whose CPU time is read
            c = time.thread_time()
            run(padded)
            forward.append((time.thread_time() - c) * 1e3)
    got: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, (mask, keep) in variants.items():
            tap_id = tap(keep)
            run(mask)
            hooks.seconds.clear()
            for _ in range(3):
                run(mask)
            got[name] += [s * 1e3 for s in hooks.seconds]
            engine.delete(tap_id)
    engine.close()
    print(f"per pass, in process (4 decoder layers, {rounds} rounds x 3 passes); untapped forward "
          f"{statistics.median(forward):.1f} ms CPU; hook CPU ms per pass:")
    for name, v in got.items():
        v.sort()
        print(f"  {name:22s} median {statistics.median(v):6.2f}  p10 {v[len(v) // 10]:6.2f}  "
              f"p90 {v[9 * len(v) // 10]:6.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=200, help="timed calls per row and block")
    ap.add_argument("--blocks", type=int, default=5, help="interleaved blocks")
    ap.add_argument("--passes", type=int, default=0, help="also time whole passes in process, this many rounds")
    args = ap.parse_args()
    torch.set_num_threads(1)  # thread CPU time then covers the whole call
    plan = ReducerPlan(build_reducers(parse_reducer_names(BASIC)), kernel=STATS)
    mask = torch.ones(8, 128, dtype=torch.long)
    mask[::2, :16] = 0
    t = torch.randn(8, 128, 256)
    print(f"torch {torch.__version__}; (8, 128, 256) float32, {BASIC}; mask: 960 of 1024 positions valid; "
          f"CPU us per call, {args.blocks} interleaved blocks x {args.calls} calls")
    for compiled in (False, True):
        STATS.set_enabled(compiled)
        with torch.inference_mode():
            if compiled:
                STATS.compile_ahead(Signature(torch.device("cpu"), torch.float32, DENSE, grad=False,
                                                       inference=True, autocast=None))
                deadline = time.monotonic() + 600
                while STATS.counters()["compiled_calls"] < 2 and time.monotonic() < deadline:
                    plan.run(t)
                    plan.run(PassPadding(mask).cut()(t))  # type: ignore[misc]
                    time.sleep(1)
            cut = PassPadding(mask).cut()
            assert cut is not None and cut.valid == 960
            rows: dict[str, list[float]] = {"whole": [], "padding left out": [], "index_select": [],
                                             "host, per pass": []}
            for _ in range(args.blocks):
                rows["whole"] += cpu_us(lambda: plan.run(t), args.calls)
                rows["padding left out"] += cpu_us(lambda: plan.run(cut(t)), args.calls)
                rows["index_select"] += cpu_us(lambda: cut(t), args.calls)
                rows["host, per pass"] += cpu_us(lambda: PassPadding(mask).cut(), args.calls)
        print(f"{'compiled (AOTInductor)' if compiled else 'eager'}: {STATS.counters()}")
        for name, v in rows.items():
            v.sort()
            print(f"  {name:18s} median {statistics.median(v):8.1f}  p10 {v[len(v) // 10]:8.1f}  "
                  f"p90 {v[9 * len(v) // 10]:8.1f}")
    if args.passes:
        per_pass(args.passes)


if __name__ == "__main__":
    main()
