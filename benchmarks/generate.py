"""Generate throughput: tokens/s of the served ``Generate`` stream against ``model.generate``, with
per-token telemetry and without, against nnsight's ``generate``, and at 1 and N clients; one run.

A random-init Llama-architecture model (``LlamaConfig``: 8 layers, hidden 512,
intermediate 1376, 8 heads, vocabulary 8192, ``eos_token_id=None`` so every
call generates all its tokens; ``save_pretrained`` into a temporary
directory, nothing downloads). One 64-token prompt, 128 new tokens, greedy.
Every row runs once per round; the rounds interleave all rows (their order
reversed every other round), and each cell is the median over rounds with
its spread [min..max]. A ratio is the median of the per-round ratios.

  model.generate  in this process, on the loaded model (a streamer only
                  notes when each token comes).
  bare loop       in this process: the forward with the model's cache and
                  an argmax, nothing else; the floor under any loop.
  Generate        ``layertap serve --model hf:DIR`` as a subprocess, called
                  through the generated stub; tokens/s is new tokens over
                  the call's wall time as the client sees it (to the
                  ``finished`` message). With no tap; with an inline tap in
                  the request (``model.layers.*``, reducers moments, minmax,
                  zero_fraction, nonfinite: a summary per layer per step);
                  with a durable tap of the same spec (CreateTap) and none
                  inline.
  nnsight         in ``--nnsight-python``'s interpreter (nnsight has its own
                  venv), a worker this script drives round by round: the
                  model's own generate, nnsight's generate with an empty
                  trace, and one that computes and ``.save()``-s mean, std,
                  min, max, zero fraction, NaN and Inf counts per layer at
                  every step (``tracer.iter[:new]``). Skipped without that flag.
  N clients       N threads, each on its own channel, each streaming one
                  Generate of the same shape at once (continuous batching).

Every process that runs the model uses ``--threads`` intra-op threads
(``torch.set_num_threads`` here, ``OMP_NUM_THREADS`` for the server and the
nnsight worker), and only one of them works at a time: the server idles
between calls, the worker waits on its stdin. The default is half the
cores: the served path has threads besides the model's (gRPC, the client
reading the stream), and an OpenMP team that loses a core to another thread
stalls at every barrier. On a 2-core machine shared with other load, two
threads made a 128-token ``model.generate`` take 30 s instead of 2 s.

Where the time goes: time to first token and per-step time (TPOT) of
``model.generate`` (its streamer's clock), of the bare loop, of the server
(``GenerationFinished``) and of the client (when the messages arrived), and
CPU time per token of the process running the forward (the server's, from
/proc) and of the client.

    python benchmarks/generate.py --rounds 5 --nnsight-python /tmp/nnsight-venv/bin/python
    python benchmarks/generate.py --device cuda          # no nnsight row
"""

from __future__ import annotations

import argparse
import inspect
import os
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from _generate_report import Run, report
from _serving import BASIC, SELECTOR, Peer, answer_rounds, load_model, process_cpu, save_llama, settle_compiles, start_server
from torch import nn

#: intermediate_size / hidden_size of the issue's model (1376 / 512).
FFN_RATIO = 43 / 16


def llama_config(args: argparse.Namespace) -> dict[str, Any]:
    return {"hidden_size": args.hidden, "intermediate_size": args.intermediate or round(args.hidden * FFN_RATIO),
            "num_hidden_layers": args.layers, "num_attention_heads": args.heads, "num_key_value_heads": args.heads,
            "vocab_size": args.vocab, "max_position_embeddings": max(256, args.prompt + args.new),
            "eos_token_id": None, "bos_token_id": None, "pad_token_id": None}


def make_prompt(prompt: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (prompt,), generator=g).tolist()


def greedy(new: int) -> dict[str, Any]:
    """``generate``'s settings: greedy; with no end-of-sequence id every call makes ``new`` tokens."""
    return {"max_new_tokens": new, "do_sample": False, "pad_token_id": 0}


class StepClock:
    """A transformers streamer that only notes the time: ``put`` gets the prompt, then each new token."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def local_generate(model: nn.Module, ids: torch.Tensor, new: int) -> Run:
    clock = StepClock()
    c0, t0 = time.process_time(), time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), streamer=clock,  # type: ignore[operator]
                             **greedy(new))
    wall = time.perf_counter() - t0
    tokens = clock.times[1:]  # times[0]: the prompt
    return Run(wall, len(tokens), tokens[0] - t0, (tokens[-1] - tokens[0]) / max(1, len(tokens) - 1),
               time.process_time() - c0, ids=tuple(out[0, ids.shape[1]:].tolist()))


def bare_loop(model: nn.Module, ids: torch.Tensor, new: int) -> Run:
    """The forward with the model's cache and an argmax per step, read back each step as any loop must."""
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    c0, t0 = time.process_time(), time.perf_counter()
    mask = torch.ones_like(ids)
    times, out_ids = [], []
    cache, step_ids = None, ids
    with torch.inference_mode():
        for _ in range(new):
            position_ids = (mask.sum(-1, keepdim=True) - 1) if cache is not None else None
            out = model(input_ids=step_ids, attention_mask=mask, position_ids=position_ids, use_cache=True,
                        logits_to_keep=1, **{cache_arg: cache})
            cache = out.get("cache", None) or out.get("past_key_values", None)
            step_ids = out["logits"][:, -1].argmax(-1, keepdim=True)
            out_ids.append(int(step_ids[0, 0]))
            times.append(time.perf_counter())
            mask = torch.cat([mask, torch.ones_like(step_ids)], dim=1)
    wall = time.perf_counter() - t0
    return Run(wall, new, times[0] - t0, (times[-1] - times[0]) / max(1, new - 1), time.process_time() - c0,
               ids=tuple(out_ids))


def reducer_specs(pb: Any) -> list[Any]:
    return [pb.ReducerSpec(kind=pb.ReducerKind.Value(f"REDUCER_KIND_{name.upper()}")) for name in BASIC]


def served_generate(stub: Any, request: Any, server_cpu: Callable[[], float] | None = None) -> Run:
    """One Generate stream, timed as its client sees it (to the ``finished`` message)."""
    c0, s0 = time.process_time(), server_cpu() if server_cpu else 0.0
    t0 = time.perf_counter()
    first = last = 0.0
    ids: list[int] = []
    summaries = 0
    finished = None
    for response in stub.Generate(request):
        now = time.perf_counter()
        summaries += len(response.summaries)
        if response.tokens:
            first = first or now
            last = now
            ids.extend(t.id for t in response.tokens)
        if response.HasField("finished"):
            finished = response.finished
    wall = time.perf_counter() - t0
    assert finished is not None and finished.generated_tokens == len(ids), "the stream ended without its tokens"
    return Run(wall, len(ids), first - t0, (last - first) / max(1, len(ids) - 1),
               (server_cpu() - s0) if server_cpu else 0.0, time.process_time() - c0,
               finished.time_to_first_token_seconds, finished.time_per_output_token_seconds, summaries,
               finished.dropped, tuple(ids))


def concurrent(stubs: Sequence[Any], request: Any) -> tuple[float, list[Run], float]:
    """Every stub streams ``request`` at once: (aggregate tokens/s, each client's run, wall s)."""
    runs: list[Run | None] = [None] * len(stubs)
    spans: list[tuple[float, float]] = [(0.0, 0.0)] * len(stubs)
    start = threading.Barrier(len(stubs))

    def client(i: int) -> None:
        start.wait()
        t0 = time.perf_counter()
        runs[i] = served_generate(stubs[i], request)
        spans[i] = (t0, time.perf_counter())

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(stubs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done = [r for r in runs if r is not None]
    assert len(done) == len(stubs), "a client failed"
    wall = max(e for _, e in spans) - min(s for s, _ in spans)
    return sum(r.tokens for r in done) / wall, done, wall


# -- nnsight (its own venv) -------------------------------------------------------
def nnsight_worker(args: argparse.Namespace) -> None:
    """Runs under ``--nnsight-python``: per line read, a JSON object of Runs (plain, empty, stats)."""
    import nnsight  # only in the nnsight venv
    raw = load_model(args.nnsight_worker, args.device)
    model = nnsight.NNsight(raw)
    ids = torch.tensor([make_prompt(args.prompt, args.vocab)], device=args.device)
    mask = torch.ones_like(ids)
    n_layers = len(model.model.layers)
    settings = greedy(args.new)

    def timed(call: Callable[[], torch.Tensor]) -> Run:
        c0, t0 = time.process_time(), time.perf_counter()
        out = call()
        wall = time.perf_counter() - t0
        return Run(wall, int(out.shape[1] - ids.shape[1]), 0.0, 0.0, time.process_time() - c0)

    def plain() -> torch.Tensor:
        with torch.inference_mode():
            return raw.generate(input_ids=ids, attention_mask=mask, **settings)  # type: ignore[no-any-return, operator]

    def empty() -> torch.Tensor:
        with torch.inference_mode(), model.trace(input_ids=ids, attention_mask=mask, fn="generate", **settings) as tracer:
            out = tracer.result.save()
        return out  # type: ignore[no-any-return]

    def stats(saved: list[Any] | None = None) -> torch.Tensor:
        saved = [] if saved is None else saved
        with torch.inference_mode(), model.trace(input_ids=ids, attention_mask=mask, fn="generate", **settings) as tracer:
            for _step in tracer.iter[:args.new]:
                for i in range(n_layers):
                    out = model.model.layers[i].output  # a Tensor in transformers 5 (no (hidden,) tuple)
                    x = (out[0] if isinstance(out, tuple) else out).float()
                    saved.append(torch.stack([x.mean(), x.std(), x.min(), x.max(), (x == 0).float().mean(),
                                              torch.isnan(x).sum().float(), torch.isinf(x).sum().float()]).save())
            result = tracer.result.save()
        return result  # type: ignore[no-any-return]

    saved: list[Any] = []
    want = plain()
    assert torch.equal(stats(saved), want) and torch.equal(empty(), want), "nnsight generated other tokens"
    assert len(saved) == n_layers * args.new, (len(saved), n_layers * args.new)
    calls = {"plain": plain, "empty": empty, "stats": stats}

    def one_round(order: str) -> dict[str, Any]:
        names = list(calls) if order == "forward" else list(reversed(calls))
        return {name: vars(timed(calls[name])) for name in names}

    answer_rounds({"version": nnsight.__version__, "threads": torch.get_num_threads(),
                   "stats_per_call": len(saved)}, one_round)


# -- the run ------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--intermediate", type=int, default=0, help="default: hidden x 43/16 (1376 for 512)")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    ap.add_argument("--new", type=int, default=128, help="new tokens per call")
    ap.add_argument("--clients", type=int, default=8, help="concurrent clients of the N-clients row")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (the server's --device too)")
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                    help="torch intra-op threads of every process that runs the model (default: half the cores)")
    ap.add_argument("--no-compile", action="store_true", help="serve with --no-compile (eager reducers)")
    ap.add_argument("--nnsight-python", help="an interpreter with nnsight installed (else the nnsight rows are skipped)")
    ap.add_argument("--nnsight-worker", metavar="DIR", help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.nnsight_worker:
        nnsight_worker(args)
        return

    import grpc
    import transformers

    from layertap.v1 import inference_pb2 as ipb
    from layertap.v1 import inference_pb2_grpc, telemetry_pb2_grpc
    from layertap.v1 import telemetry_pb2 as pb

    config = llama_config(args)
    prompt = make_prompt(args.prompt, args.vocab)
    threads_env = {"OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    request = ipb.GenerateRequest(prompts=[ipb.TokenIds(ids=prompt)], max_new_tokens=args.new)
    tapped = ipb.GenerateRequest(prompts=[ipb.TokenIds(ids=prompt)], max_new_tokens=args.new,
                                 taps=[pb.TapSpec(selector=SELECTOR, reducers=reducer_specs(pb))])
    durable_spec = pb.CreateTapRequest(spec=pb.TapSpec(selector=SELECTOR, reducers=reducer_specs(pb)), forever=True)
    runs: dict[str, list[Run]] = {k: [] for k in ("local", "bare", "served", "inline", "durable",
                                                  "nn plain", "nn empty", "nn stats")}
    many: list[tuple[float, list[Run]]] = []
    compiled = 0.0
    refused = ""  # why the server refused the inline tap, if it did
    with tempfile.TemporaryDirectory(prefix="layertap-llama-") as directory:
        save_llama(directory, config)
        model = load_model(directory, args.device)
        ids = torch.tensor([prompt], device=args.device)
        peer = None
        if args.nnsight_python:
            peer = Peer([args.nnsight_python, __file__, "--nnsight-worker", directory, "--prompt", str(args.prompt),
                         "--new", str(args.new), "--vocab", str(args.vocab), "--device", args.device,
                         "--threads", str(args.threads)], env=threads_env)
        extra = ["--device", args.device, "--max-new-tokens", str(max(16, args.new)),
                 "--max-generate-rows", str(max(16, args.clients)), "--max-streams", str(max(48, 2 * args.clients))]
        proc, address, metrics_port = start_server(directory, extra + (["--no-compile"] if args.no_compile else []),
                                                   env=threads_env)
        channels = [grpc.insecure_channel(address) for _ in range(args.clients)]
        try:
            stubs = [inference_pb2_grpc.InferenceServiceStub(c) for c in channels]
            stub, telemetry = stubs[0], telemetry_pb2_grpc.TelemetryServiceStub(channels[0])
            server_cpu = process_cpu(proc.pid)

            def durable() -> Run:
                tap = telemetry.CreateTap(durable_spec).tap.id
                try:
                    return served_generate(stub, request, server_cpu)
                finally:
                    telemetry.DeleteTap(pb.DeleteTapRequest(id=tap))

            # Warm-up, and the checks: the served tokens are model.generate's; a tapped call
            # gets a summary per layer per step; the reducers' compiles are over before timing.
            reference = local_generate(model, ids, args.new)
            bare_loop(model, ids, args.new)
            first = served_generate(stub, request, server_cpu)
            agree = next((i for i, (a, b) in enumerate(zip(first.ids, reference.ids)) if a != b), len(first.ids))
            try:
                check: Run | None = served_generate(stub, tapped, server_cpu)
            except grpc.RpcError as exc:
                check, refused = None, f"{exc.code().name}: {exc.details()}"
            durable()
            if not args.no_compile:
                compiled = settle_compiles(metrics_port)
            if check is not None:
                check = served_generate(stub, tapped, server_cpu)
            durable()
            concurrent(stubs, request)
            if not args.no_compile:
                compiled = settle_compiles(metrics_port, quiet=2)

            rows: list[tuple[str, Callable[[], Run]]] = [
                ("local", lambda: local_generate(model, ids, args.new)),
                ("bare", lambda: bare_loop(model, ids, args.new)),
                ("served", lambda: served_generate(stub, request, server_cpu)),
                ("inline", lambda: served_generate(stub, tapped, server_cpu)),
                ("durable", durable)]
            if check is None:
                rows = [row for row in rows if row[0] != "inline"]
            for r in range(args.rounds):
                order = rows if r % 2 == 0 else rows[::-1]
                if r % 2 == 1:
                    many.append(concurrent(stubs, request)[:2])
                for key, call in order:
                    runs[key].append(call())
                if peer is not None:
                    for name, run in peer.ask("forward" if r % 2 == 0 else "reverse").items():
                        runs[f"nn {name}"].append(Run(**{k: tuple(v) if k == "ids" else v for k, v in run.items()}))
                if r % 2 == 0:
                    many.append(concurrent(stubs, request)[:2])
        finally:
            for c in channels:
                c.close()
            proc.terminate()
            proc.wait(30)
            if peer is not None:
                peer.close()

    report(args, config, runs, many, compiled=compiled, agree=agree, check=check, refused=refused,
           versions={"transformers": transformers.__version__, "grpcio": grpc.__version__,
                     "nnsight": str(peer.hello["version"]) if peer else "-"},
           nnsight_threads=peer.hello["threads"] if peer else None)




if __name__ == "__main__":
    main()
