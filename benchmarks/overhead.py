"""Hook overhead: step time with taps vs an unhooked baseline, side by side.

In process, no gRPC. Variants run interleaved (base, a, base, b, ...) for
``--repeats`` rounds; each measurement is the median of ``--steps`` timed
forward passes. The ratio of a round is variant / the base run next to it;
the script prints the median ratio and its spread (min..max) over rounds.

Variants:
  0  nothing installed: base against base, the spread any ratio carries
  a  seed-style hooks: ``.item()`` per statistic (mean, std, min, max, zeros, nan, inf)
  b  layertap taps: moments, minmax, zero_fraction, nonfinite on every block-level module; each
     firing is one ``layertap::tap_stats`` call (issue 42)
  q  b on the plan path (``serve --no-tap-op``): the reducer plan in the hook, the compiled
     kernel once ready, small tensors batched per pass (the path before issue 42)
  c  b + histogram + quantiles
  d  b with every=10 (nonfinite still on every pass)
  e, f, g  b, c, d with the compiled (inductor) basic-statistics kernel, after
     its background compiles finished (``--no-compile`` drops these rows)
  e0  e with the host-transfer thread at the model thread's priority (``--telemetry-nice 0``;
     every other row's host-transfer thread runs at the default, 10 nicer; Linux only)
  h  f with the sample sorted by torch's float64 comparison sort (the CPU
     sort before issue 10, and the CUDA path's sort; ``--float-sort`` adds
     this row, to compare in one run; it swaps ``workspace.sort_ascending``)
  r:<name>  one reducer alone (``--reducers`` adds these rows)
  n, p  the plan path's own floor (``--engine`` adds these rows): every plan's
     ``run`` replaced by a cached slot vector of the right width, so no
     reducer runs: n publishes each pass as the server does, p publishes
     nothing (the model thread's share alone)
  o  b with the op's call replaced by a no-op (``--engine``): the op path's floor, its Python

CPU default: the demo model, batch 32. GPU: ``--model resnet50 --dtype bfloat16
--batch 64 --device cuda --channels-last`` taps the 22 block-level modules
(16 Bottlenecks, layer1-4, avgpool, fc).
"""

from __future__ import annotations

import argparse
import functools
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch
from torch import nn

from layertap.server.app import process_compilation
from layertap.server.host.allocator import tune_malloc
from layertap.server.host.model_host import ModelHost
from layertap.server.host.priority import DEFAULT_TELEMETRY_NICE, set_telemetry_nice
from layertap.server.host.sources import load_model
from layertap.server.reducers import workspace
from layertap.server.reducers.plan import ReducerPlan
from layertap.server.stream.broker import Broker
from layertap.server.taps import firing
from layertap.server.taps.engine import TapEngine
from layertap.server.taps.tap_files import reducer_spec
from layertap.v1 import telemetry_pb2 as pb

#: The process's compiled statistics kernel and pass registry, as a server gets them from app.py.
SHARED = process_compilation()
STATS = SHARED.stats

sample_sort = workspace.sort_ascending


def float_sort(s: torch.Tensor) -> torch.Tensor:
    """The sample sort before issue 10 (variant h): ``torch.sort`` of the float64 values."""
    return torch.sort(s.to(torch.float64)).values


BASIC = ["moments", "minmax", "zero_fraction", "nonfinite"]
ALL = ["moments", "minmax", "abs_max", "zero_fraction", "nonfinite", "norm", "histogram", "quantiles", "per_channel",
       "latency"]


def block_level(model: nn.Module) -> list[str]:
    """The 'block-level' modules: residual blocks, layer1..4, avgpool, fc."""
    names = []
    for name, _ in model.named_children():
        if name.startswith("layer"):
            names.append(name)
            names += [f"{name}.{child}" for child, _ in getattr(model, name).named_children()]
        elif name in ("avgpool", "fc"):
            names.append(name)
    return names


def seed_style_hooks(model: nn.Module, layers: list[str]) -> Callable[[], None]:
    """The tutorial approach: one host sync per statistic."""
    sink: list[float] = []

    def hook(_m: nn.Module, _a: object, out: torch.Tensor) -> None:
        x = out.float()
        sink.extend([x.mean().item(), x.std().item(), x.min().item(), x.max().item(),
                     (x == 0).float().mean().item(), torch.isnan(x).sum().item(), torch.isinf(x).sum().item()])

    handles = [model.get_submodule(n).register_forward_hook(hook) for n in layers]
    return lambda: [h.remove() for h in handles] and None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--channels-last", action="store_true")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--reducers", action="store_true", help="also time each reducer alone")
    ap.add_argument("--no-compile", action="store_true", help="skip the compiled-kernel variants")
    ap.add_argument("--engine", action="store_true", help="also time the engine with no-op reducers")
    ap.add_argument("--float-sort", action="store_true",
                    help="also time f with the float64 sort of the sample (before issue 10's key sort)")
    ap.add_argument("--malloc-tuning", action="store_true",
                    help="tune glibc malloc as `layertap serve --malloc-tuning` does (host.allocator)")
    args = ap.parse_args()
    malloc = (tune_malloc() or "on") if args.malloc_tuning else "off"  # as `layertap serve --malloc-tuning`

    dtype = getattr(torch, args.dtype)
    loaded = load_model(args.model)
    host = ModelHost(loaded, device=args.device, dtype=dtype, passes=SHARED.passes)
    if args.channels_last:
        host.module = host.module.to(memory_format=torch.channels_last)
    broker = Broker(default_queue_size=4)
    set_telemetry_nice(0)  # e0's engine: its host-transfer thread starts at the model thread's priority
    engine_nice0 = TapEngine(host, broker, max_taps=1000, stats=STATS)
    set_telemetry_nice(DEFAULT_TELEMETRY_NICE)
    engine = TapEngine(host, broker, max_taps=1000, stats=STATS)
    sub = broker.subscribe(None, queue_size=4)  # a live subscriber (drops are fine)
    layers = block_level(host.module)
    shape = [args.batch if d == -1 else d for d in host.inputs[0].shape]
    x = torch.randn(shape, device=args.device, dtype=dtype)
    if args.channels_last and x.dim() == 4:
        x = x.contiguous(memory_format=torch.channels_last)
    cuda = host.device.type == "cuda"

    def step_time() -> float:
        times = []
        for _ in range(args.steps):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            with host.pass_context(), torch.inference_mode():
                host.module(x)
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        engine.flush(30)
        engine_nice0.flush(30)
        while sub.get(timeout=0) is not None:
            pass
        return statistics.median(times)

    def taps(reducers: list[str], every: int = 0, on: TapEngine = engine, op: bool = True) -> Callable[[], None]:
        on.use_op = op  # read when taps change: the taps below take the op path or the plan path
        ids = []
        for layer in layers:
            t = on.create(pb.TapSpec(selector=layer, reducers=[reducer_spec(r, "r") for r in reducers],
                                     sampling=pb.Sampling(every_n=every)), forever=True)
            ids.append(t.id)
        return lambda: [on.delete(i) for i in ids] and None

    variants: dict[str, Callable[[], Callable[[], None]]] = {
        "0 no hooks either (A/A: the noise floor)": lambda: lambda: None,
        "a seed .item() hooks": lambda: seed_style_hooks(host.module, layers),
        "b taps: moments,minmax,zero_fraction,nonfinite": lambda: taps(BASIC),
        "c b + histogram + quantiles": lambda: taps(BASIC + ["histogram", "quantiles"]),
        "d b with every=10": lambda: taps(BASIC, every=10),
    }
    compiled_variants: list[str] = []
    if not args.no_compile:
        def with_compiled(install: Callable[[], Callable[[], None]]) -> Callable[[], Callable[[], None]]:
            def installed() -> Callable[[], None]:
                STATS.set_enabled(True)
                remove = install()

                def undo() -> None:
                    remove()
                    STATS.set_enabled(False)
                return undo
            return installed

        for key, label, base_variant in (("e", "b", BASIC), ("f", "c", BASIC + ["histogram", "quantiles"]),
                                         ("g", "d", BASIC)):
            name = f"{key} {label}, compiled basic statistics"
            variants[name] = with_compiled(functools.partial(taps, base_variant, 10 if label == "d" else 0))
            compiled_variants.append(name)
        name = "q b on the plan path, compiled (before the op)"
        variants[name] = with_compiled(functools.partial(taps, BASIC, 0, engine, False))
        compiled_variants.append(name)
        if sys.platform.startswith("linux"):
            name = "e0 e, host-transfer at the model's priority"
            variants[name] = with_compiled(functools.partial(taps, BASIC, 0, engine_nice0))
            compiled_variants.append(name)
        if args.float_sort:
            def float_sorted(install: Callable[[], Callable[[], None]]) -> Callable[[], Callable[[], None]]:
                def installed() -> Callable[[], None]:
                    workspace.sort_ascending = float_sort
                    remove = install()

                    def undo() -> None:
                        remove()
                        workspace.sort_ascending = sample_sort
                    return undo
                return installed

            name = "h f with the float64 sort (before)"
            variants[name] = float_sorted(variants["f c, compiled basic statistics"])
            compiled_variants.append(name)
    if args.engine:
        def no_op(publish: bool = True) -> Callable[[], Callable[[], None]]:
            def installed() -> Callable[[], None]:
                cache: dict[tuple[int, tuple[int, ...]], torch.Tensor] = {}
                run = ReducerPlan.run

                def cached(plan: ReducerPlan, t: torch.Tensor) -> torch.Tensor:
                    key = (id(plan), tuple(t.shape))
                    hit = cache.get(key)
                    if hit is None:
                        hit = cache[key] = run(plan, t)  # once per layer, before timing's steady state
                    return hit

                submit = engine.transfer.submit
                ReducerPlan.run = cached  # type: ignore[method-assign]
                if not publish:
                    engine.transfer.submit = lambda *a, **k: True  # type: ignore[method-assign]
                remove = taps(BASIC, op=False)

                def undo() -> None:
                    remove()
                    ReducerPlan.run = run  # type: ignore[method-assign]
                    engine.transfer.submit = submit  # type: ignore[method-assign]
                return undo
            return installed

        variants["n plan path, no-op reducers"] = no_op()
        variants["p n, nothing published (model thread only)"] = no_op(publish=False)

        def no_op_call() -> Callable[[], None]:
            real = firing.tap_stats_op
            firing.tap_stats_op = lambda *a: None  # nothing written: the rows keep the identity
            remove = taps(BASIC)

            def undo() -> None:
                remove()
                firing.tap_stats_op = real
            return undo

        variants["o b, the op a no-op (the op path's Python)"] = no_op_call
    if args.reducers:
        for r in ALL:
            variants[f"r {r} alone"] = lambda r=r: taps([r])

    for _ in range(3):  # warm up
        step_time()
    for name in compiled_variants:  # first sightings queue compiles; none is timed
        remove = variants[name]()
        try:
            step_time()
            STATS.wait_idle(600)
            step_time()
        finally:
            remove()
    first_calls = STATS.counters()
    ratios: dict[str, list[float]] = {k: [] for k in variants}
    base_times: list[float] = []
    for _ in range(args.repeats):
        for name, install in variants.items():
            base = step_time()
            remove = install()
            try:
                t = step_time()
            finally:
                remove()
            base_times.append(base)
            ratios[name].append(t / base)
    assert host.hooks.active == 0

    dev = torch.cuda.get_device_name() if cuda else platform.processor() or platform.machine()
    print(f"model={args.model} device={args.device} ({dev}) dtype={args.dtype} batch={args.batch} "
          f"channels_last={args.channels_last} taps={len(layers)} torch={torch.__version__} malloc tuning={malloc}")
    print(f"base step median {statistics.median(base_times) * 1e3:.2f} ms; "
          f"{args.repeats} interleaved rounds x {args.steps} steps")
    print(f"{'variant':52s} {'median':>7s}  spread")
    for name, rs in ratios.items():
        print(f"{name:52s} {statistics.median(rs):6.2f}x  [{min(rs):.2f}..{max(rs):.2f}]")
    if compiled_variants:
        timed = {k: v - first_calls[k] for k, v in STATS.counters().items()}
        print(f"compiled kernel: {len(STATS.states())} signatures {set(STATS.states().values())}; "
              f"during timing {timed}")
    STATS.close()
    engine.close()
    engine_nice0.close()


if __name__ == "__main__":
    main()
