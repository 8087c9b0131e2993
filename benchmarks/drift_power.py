"""Drift alarm power and false alarms through the public API (issue 26).

    python benchmarks/drift_power.py [--sections demo,transformer] [--calm-windows 100] [--out DIR] \
        [--alibi-python /work/venv-alibi/bin/python] [--evidently-python /work/venv-evidently/bin/python]

Two sections, each a server in process reached over gRPC by ``layertap.Client`` only, a
baseline of ``--passes`` (500) live passes frozen with window 50, then the same measurements:

* demo: the demo model, N(0, 1) inputs (batch 8), layer1-4; shifts of the input: mean
  +0.05σ, +0.1σ, +0.2σ; scale × 1.05, × 1.1.
* transformer: a tiny random-init Llama (``TF_CONFIG``: 4 decoder layers, hidden 64, vocab
  512; ``save_pretrained`` to a temporary directory, nothing downloads) served from
  ``--model hf:DIR`` (the same loader as ``layertap serve --model hf:DIR``), batch 4 x 32 token
  ids, the baseline on ``model.layers.*`` (per-feature axis: hidden). In distribution the
  token ranks follow Zipf(s = 1.1) over the vocabulary (ids a fixed permutation of the
  ranks); shifts of the token distribution: Zipf s = 1.0 and 1.3, and a topic shift where 5 %
  or 20 % of the tokens come uniformly from a 32-token mid-frequency sub-vocabulary.

Per section: ``--calm-windows`` in-distribution windows (the calibrated alarm's false alarms;
an alarm raised in a window stays up until a clean window completes, so one read per window
sees each), then for each shift clean windows until no alarm is up and one shifted window with
a read after every pass: the layers flagged within the window, and the passes to detection
(counted here from the shift's first pass, and as the server reports it). Beside the alarm,
Evidently's default rule for numeric columns (normed Wasserstein > 0.1) reproduced on the
server's pooled histogram of each layer's raw activations (its ``wasserstein`` score).

With ``--out`` the same windows are written as ``.npy`` files of per-pass features (each
pass's per-feature means of the layer: channels of the demo model, hidden units of the Llama;
computed on a local copy of the served model, same seed, same inputs; the transformer's go
under ``DIR/transformer``). Peers score those files, each in its own venv, side by side:

* ``--evidently-python``: Evidently (0.7.x from PyPI; pandas<3, no torch),
  ``benchmarks/_drift_evidently.py``. A layer becomes one numerical column per feature, one
  row per pass, reference = the baseline's passes, current = one window; Evidently's
  ``DriftedColumnsCount`` (the metric of ``DataDriftPreset``) with ``method="wasserstein"``,
  ``threshold=0.1`` per column, and the dataset drifted at its default ``drift_share`` 0.5.
  Per-feature columns because that is how Evidently reads a table, and they are the rows the
  MMD peer sees; the pooled alternative (one column of all activations) is the reproduced rule
  above, on the raw activations these files do not hold.
* ``--alibi-python``: alibi-detect 0.13 (numpy<2) with its MMD drift detector
  (``benchmarks/_drift_alibi.py``, p = 0.05).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

import layertap
from layertap.server.app import start_server
from layertap.server.config import ServerConfig
from layertap.server.host.demo_model import build_demo_model

LAYERS = ["layer1", "layer2", "layer3", "layer4"]
SHIFTS = [("+0.05σ", 0.05, 1.0), ("+0.1σ", 0.1, 1.0), ("+0.2σ", 0.2, 1.0), ("×1.05", 0.0, 1.05), ("×1.1", 0.0, 1.1)]
EVIDENTLY_W1 = 0.1
#: The transformer section's model: a tiny random-init Llama (seed 0), saved and served as ``hf:DIR``.
TF_CONFIG = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
#: In distribution: token ranks drawn from Zipf(s) over the vocabulary (ids = a fixed permutation of ranks).
TF_ZIPF = 1.1
#: The topic shift's sub-vocabulary: ranks 64-95 (32 mid-frequency tokens), drawn uniformly.
TF_TOPIC = slice(64, 96)
TF_SHIFTS: list[tuple[str, Any]] = [("zipf s=1.0", ("zipf", 1.0)), ("zipf s=1.3", ("zipf", 1.3)),
                                    ("topic 5%", ("topic", 0.05)), ("topic 20%", ("topic", 0.20))]


class Traffic:
    """Sends inputs through Infer and computes the same passes' per-feature means locally (for the .npy files).

    ``model`` is a local copy of the served model (same seed, same weights); ``modules`` maps each
    tapped layer to its module there; ``draw(rng, param)`` makes one input; ``send(client, x)`` sends it
    and ``local(model, x)`` runs it here; ``dims`` are the dimensions a pass's feature means over
    (everything but the per-feature axis).
    """

    def __init__(self, client: layertap.Client, srv: Any, seed: int, model: torch.nn.Module,
                 modules: dict[str, torch.nn.Module], draw: Any, send: Any, local: Any, dims: tuple[int, ...]) -> None:
        self.client, self.srv, self.model, self.layers = client, srv, model, list(modules)
        self.draw, self.send, self.local, self.dims = draw, send, local, dims
        self.rng = np.random.default_rng(seed)
        self._feat: dict[str, np.ndarray] = {}
        for name, module in modules.items():
            module.register_forward_hook(self._hook(name))

    def _hook(self, name: str) -> Any:
        def hook(_m: Any, _i: Any, out: Any) -> None:
            out = out[0] if isinstance(out, tuple) else out
            self._feat[name] = out.double().mean(dim=self.dims).numpy()
        return hook

    def passes(self, n: int, param: Any = None, each: Any = None) -> dict[str, np.ndarray]:
        rows: dict[str, list[np.ndarray]] = {name: [] for name in self.layers}
        for i in range(n):
            x = self.draw(self.rng, param)
            self.send(self.client, x)
            with torch.no_grad():
                self.local(self.model, x)
            for name in self.layers:
                rows[name].append(self._feat[name])
            if each is not None:
                assert self.srv.state.taps.flush(20)
                each(i + 1)
        assert self.srv.state.taps.flush(20), "tap pipeline did not drain"
        return {name: np.stack(r) for name, r in rows.items()}


def drift(client: layertap.Client) -> dict[str, Any]:
    return {d.layer: d for d in client.drift()}


def cost(calls: int, batch: int, passes: int, window: int) -> None:
    """Per-pass cost of a baseline tap, the calibrated alarm against fixed thresholds, interleaved in one run.

    Three in-process servers, the same demo model: no tap, a frozen baseline over layer1-4
    with fixed thresholds (the scoring path as it was before calibration: same reducers,
    no alarm), and the same baseline calibrated. Calls rotate among them, so the shared
    cores' load falls on all three alike; the statistic is the median Infer wall time.
    """
    srvs = [start_server(ServerConfig(port=0, metrics_port=None, compile_reducers=False), None) for _ in range(3)]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, 3, 32, 32)).astype(np.float32)
    try:
        clients = [layertap.Client(f"127.0.0.1:{s.port}") for s in srvs]
        clients[1].set_baseline("layer*", passes=passes, window=window, thresholds={"psi": 0.2})
        clients[2].set_baseline("layer*", passes=passes, window=window)
        for _ in range(passes):
            for c in clients:
                c.infer(x)
        for s in srvs:
            assert s.state.taps.flush(20)
        assert [d.calibration for d in clients[1].drift()] == ["fixed"] * 4
        assert [d.calibration for d in clients[2].drift()] == ["calibrated"] * 4
        times: list[list[float]] = [[], [], []]
        for i in range(calls):
            for j in ((0, 1, 2), (1, 2, 0), (2, 0, 1))[i % 3]:
                t = time.perf_counter()
                clients[j].infer(x)
                times[j].append(time.perf_counter() - t)
        for s in srvs:
            assert s.state.taps.flush(20)
        med = [float(np.median(t)) * 1e3 for t in times]
        print(f"per-pass Infer, batch {batch}, {calls} calls each, interleaved: untapped {med[0]:.2f} ms, "
              f"baseline tap with fixed thresholds {med[1]:.2f} ms, calibrated {med[2]:.2f} ms")
        print(f"  calibrated / fixed = {med[2] / med[1]:.3f}x; tap cost over untapped: fixed +{med[1] - med[0]:.2f} ms, "
              f"calibrated +{med[2] - med[0]:.2f} ms")
        for c in clients:
            c.close()
    finally:
        for s in srvs:
            s.stop(0)


def section(args: argparse.Namespace, srv: Any, traffic: Traffic, selector: str,
            shifts: list[tuple[str, Any]], calm_windows: int, out: Path, what: str) -> dict[str, Any]:
    """Baseline, in-distribution windows and one window per shift on one served model; writes the .npy files."""
    client, layers, w = traffic.client, traffic.layers, args.window
    client.set_baseline(selector, passes=args.passes, window=w)
    base = traffic.passes(args.passes)
    # Under full CPU load the telemetry threads (nice 19) fall behind and drop passes,
    # counted: then the baseline needs a few more to freeze.
    while not all(d.state == "ready" for d in drift(client).values()):
        more = traffic.passes(10)
        base = {n: np.concatenate((base[n], more[n])) for n in layers}
    for name in layers:
        np.save(out / f"base_{name}.npy", base[name])
    frozen = drift(client)
    assert sorted(frozen) == sorted(layers), sorted(frozen)
    print(f"baseline: {args.passes} passes of {what}, window {w}; "
          + ", ".join(f"{n} {frozen[n].calibration} thr {frozen[n].threshold:.2f}" for n in layers))

    calm: dict[str, list[np.ndarray]] = {name: [] for name in layers}
    false_alarms = dict.fromkeys(layers, 0)
    fixed_alarms = dict.fromkeys(layers, 0)
    max_ratio = dict.fromkeys(layers, 0.0)
    raised = dict.fromkeys(layers, 0)
    for _ in range(calm_windows):
        feats = traffic.passes(w)
        d = drift(client)
        for name in layers:
            calm[name].append(feats[name])
            # A new alarm has a new alarm_pass (passes dropped under load shift the server's
            # windows against these chunks of 50; each alarm still counts once).
            if d[name].alarm and d[name].alarm_pass != raised[name]:
                false_alarms[name] += 1
                raised[name] = d[name].alarm_pass
            fixed_alarms[name] += int(d[name].wasserstein > EVIDENTLY_W1)
            max_ratio[name] = max(max_ratio[name], d[name].ratio)
    for name in layers:
        np.save(out / f"calm_{name}.npy", np.stack(calm[name]))
    now = drift(client)
    layer_windows = sum(d.windows for d in now.values())
    ignored = sum(d.ignored_passes for d in now.values())

    rows = []
    clean: dict[str, Any] = {}
    for label, param in shifts:
        # Clean windows first, until the previous shift's alarm clears: a CUSUM still
        # carries that shift's evidence for a while, and may fire once more early on.
        for clear_windows in range(1, 4):
            traffic.passes(w)
            clean = drift(client)
            if not any(c.alarm for c in clean.values()):
                break
        first: dict[str, int] = {}

        def seen(i: int) -> None:
            for n, d in drift(client).items():
                if d.alarm and n not in first:
                    first[n] = i

        feats = traffic.passes(w, param, each=seen)
        for name in layers:
            np.save(out / f"shift_{label}_{name}.npy", feats[name])
        d = drift(client)
        rows.append({"shift": label, "cleared": not any(c.alarm for c in clean.values()),
                     "clean_windows": clear_windows,
                     "flagged": [n for n in layers if n in first],
                     "passes_to_detection": {n: first.get(n) for n in layers},
                     "server_detection_passes": {n: d[n].detection_passes for n in layers},
                     "ratio": {n: round(d[n].ratio, 1) for n in layers},
                     "w1": {n: round(d[n].wasserstein, 3) for n in layers},
                     "fixed_flagged": [n for n in layers if d[n].wasserstein > EVIDENTLY_W1]})
    return {"layers": layers, "calm_windows": calm_windows, "layer_windows": layer_windows, "ignored": ignored,
            "false_alarms": false_alarms, "fixed_false_alarms": fixed_alarms,
            "max_ratio": round(max(max_ratio.values()), 2), "shifts": rows, "out": str(out)}


def peer(python: str | None, helper: str, res: dict[str, Any]) -> dict[str, Any] | None:
    """Runs ``benchmarks/_drift_<helper>.py`` under ``python`` (another venv) on a section's windows."""
    if not python:
        return None
    script = Path(__file__).with_name(f"_drift_{helper}.py")
    t = time.monotonic()
    run = subprocess.run([python, str(script), res["out"], ",".join(r["shift"] for r in res["shifts"]),
                          ",".join(res["layers"])], capture_output=True, text=True, check=False)
    if run.returncode:
        print(f"{helper} run failed:\n{run.stderr[-2000:]}", file=sys.stderr)
        return None
    got: dict[str, Any] = json.loads(run.stdout.strip().splitlines()[-1])
    got["seconds"] = round(time.monotonic() - t, 1)
    return got


def report(title: str, res: dict[str, Any], alibi: dict[str, Any] | None, evid: dict[str, Any] | None) -> None:
    layers, k = res["layers"], len(res["layers"])
    print(f"\n== {title}")
    print(f"in distribution, {res['calm_windows']} windows x {k} layers sent; the server "
          f"completed {res['layer_windows']} layer-windows ({res['ignored']} passes left out)")
    print(f"  calibrated alarm: {sum(res['false_alarms'].values())} false alarms "
          f"(largest score/threshold {res['max_ratio']:.2f})  {res['false_alarms']}")
    print(f"  server pooled-histogram W1 > {EVIDENTLY_W1} (Evidently's rule, reproduced): "
          f"{sum(res['fixed_false_alarms'].values())} false alarms")
    if evid is not None:
        print(f"  Evidently {evid['version']} (wasserstein stattest 0.1 per feature column, dataset drift at share "
              f">= {evid['drift_share']}): {evid['calm_false']} false alarms over {evid['calm_windows']} layer-windows "
              f"(median share of drifted columns {evid['calm_share_median']:.2f}, max {evid['calm_share_max']:.2f}; "
              f"{evid['seconds']} s)")
    if alibi is not None:
        print(f"  alibi-detect MMD (p = 0.05): {alibi['calm_false']} false alarms "
              f"over {alibi['calm_windows']} layer-windows ({alibi['seconds']} s)")
    w = k
    print("\nshift (one window)  calibrated: flagged  passes to detection (here / server)   pooled W1 > 0.1: flagged"
          + ("   Evidently: flagged [share per layer]" if evid else "") + ("   MMD p<0.05: flagged" if alibi else ""))
    for r in res["shifts"]:
        det = " ".join(f"{r['passes_to_detection'][n] or '-'}/{r['server_detection_passes'][n] or '-'}" for n in layers)
        line = f"  {r['shift']:<10} {len(r['flagged'])}/{w}   {det:<32}  {len(r['fixed_flagged'])}/{w}"
        if evid:
            e = evid["shift"][r["shift"]]
            line += f"   {len(e['flagged'])}/{w} {[round(x, 2) for x in e['share']]}"
        if alibi:
            line += f"   {len(alibi['shift'][r['shift']])}/{w}"
        print(line + ("" if r["cleared"] else "   (alarm had not cleared before this shift)"))
    print("clean windows before each shift: " + ", ".join(f"{r['shift']} {r['clean_windows']}" for r in res["shifts"]))
    print("score/threshold at the end of each shifted window: " + "; ".join(
        f"{r['shift']} {list(r['ratio'].values())}" for r in res["shifts"]))
    print("pooled W1 at the end of each shifted window: " + "; ".join(
        f"{r['shift']} {list(r['w1'].values())}" for r in res["shifts"]))


def zipf(vocab: int, s: float) -> np.ndarray:
    p = 1.0 / np.arange(1, vocab + 1) ** s
    return p / p.sum()


def demo_section(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    srv = start_server(ServerConfig(port=0, metrics_port=None, compile_reducers=False), None)
    try:
        with layertap.Client(f"127.0.0.1:{srv.port}") as client:
            model = build_demo_model(0).eval()
            traffic = Traffic(
                client, srv, args.seed, model, {n: getattr(model, n) for n in LAYERS},
                draw=lambda rng, p: ((rng.standard_normal((args.batch, 3, 32, 32)) * (p or (0, 1))[1]
                                      + (p or (0, 1))[0]).astype(np.float32)),
                send=lambda c, x: c.infer(x), local=lambda m, x: m(torch.from_numpy(x)), dims=(0, 2, 3))
            return section(args, srv, traffic, "layer*", [(label, (sh, sc)) for label, sh, sc in SHIFTS],
                           args.calm_windows, out, f"N(0, 1), batch {args.batch}")
    finally:
        srv.stop(0)


def transformer_section(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """A tiny random-init Llama served from its ``save_pretrained`` directory (``hf:DIR``)."""
    from _serving import load_model, save_llama

    vocab, b, t = TF_CONFIG["vocab_size"], args.tf_batch, args.tf_tokens
    # Token ranks map to ids through a fixed permutation, so "frequent" is not "small id".
    ids_of_rank = np.random.default_rng(0).permutation(vocab)
    base_p = zipf(vocab, TF_ZIPF)

    def dist(param: Any) -> np.ndarray:
        if param is None:
            return base_p
        kind, v = param
        if kind == "zipf":
            return zipf(vocab, v)
        topic = np.zeros(vocab)  # a topic: a uniform sub-vocabulary of mid-frequency ranks
        topic[TF_TOPIC] = 1.0 / len(range(vocab)[TF_TOPIC])
        return (1 - v) * base_p + v * topic

    dists = {label: dist(param) for label, param in [("", None), *TF_SHIFTS]}

    def draw(rng: np.random.Generator, param: Any) -> np.ndarray:
        p = dists[param] if param is not None else dists[""]
        return ids_of_rank[rng.choice(vocab, size=(b, t), p=p)].astype(np.int64)

    directory = tempfile.mkdtemp(prefix="drift-llama-")
    save_llama(directory, TF_CONFIG)
    srv = start_server(ServerConfig(port=0, metrics_port=None, compile_reducers=False, model=f"hf:{directory}"), None)
    try:
        with layertap.Client(f"127.0.0.1:{srv.port}") as client:
            model = load_model(directory)
            layers = {f"model.layers.{i}": model.model.layers[i] for i in range(TF_CONFIG["num_hidden_layers"])}
            traffic = Traffic(client, srv, args.seed, model, layers, draw=draw,
                              send=lambda c, x: c.infer(input_ids=x),
                              local=lambda m, x: m(input_ids=torch.from_numpy(x)), dims=(0, 1))
            x = draw(np.random.default_rng(9), None)
            served = np.asarray(client.infer(input_ids=x)["logits"])
            with torch.no_grad():
                assert np.allclose(served, model(input_ids=torch.from_numpy(x)).logits.numpy(), atol=1e-4)
            return section(args, srv, traffic, "model.layers.*", [(label, label) for label, _ in TF_SHIFTS],
                           args.tf_calm_windows, out,
                           f"Zipf(s={TF_ZIPF}) token ids over {vocab}, batch {b} x {t} tokens")
    finally:
        srv.stop(0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--passes", type=int, default=500)
    p.add_argument("--window", type=int, default=50)
    p.add_argument("--calm-windows", type=int, default=100)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--sections", default="demo,transformer", help="demo, transformer or both (default)")
    p.add_argument("--tf-calm-windows", type=int, default=100, help="in-distribution windows of the transformer")
    p.add_argument("--tf-batch", type=int, default=4)
    p.add_argument("--tf-tokens", type=int, default=32)
    p.add_argument("--out", help="directory for the windows' .npy files (default: a temporary one)")
    p.add_argument("--alibi-python", help="python of a venv with alibi-detect 0.13: score the same windows with MMD")
    p.add_argument("--evidently-python", help="python of a venv with evidently: score the same windows with its "
                                              "data-drift preset (Wasserstein, threshold 0.1)")
    p.add_argument("--cost", type=int, default=0, metavar="CALLS",
                   help="only measure a baseline tap's per-pass cost, calibrated against fixed, with CALLS calls each")
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.cost:
        cost(args.cost, args.batch, args.passes, args.window)
        return
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    if not sections or any(s not in ("demo", "transformer") for s in sections):
        p.error(f"--sections: demo, transformer or both, got {args.sections!r}")
    out = Path(args.out or tempfile.mkdtemp(prefix="drift-power-"))
    results: dict[str, Any] = {}
    for name in sections:
        t0 = time.monotonic()
        where = out if name == "demo" else out / name
        where.mkdir(parents=True, exist_ok=True)
        res = demo_section(args, where) if name == "demo" else transformer_section(args, where)
        res["seconds"] = round(time.monotonic() - t0)
        res["evidently"] = peer(args.evidently_python, "evidently", res)
        res["alibi"] = peer(args.alibi_python, "alibi", res)
        title = ("demo model, layer1-4, input shifts" if name == "demo" else
                 f"tiny Llama (hf:DIR, {TF_CONFIG['num_hidden_layers']} layers, hidden {TF_CONFIG['hidden_size']}), "
                 "token-distribution shifts")
        report(title, res, res["alibi"], res["evidently"])
        print(f"wall time {res['seconds']} s (before the peers); windows in {where}")
        results[name] = res
    demo = results.get("demo", {})
    print(json.dumps({"false_alarms": demo.get("false_alarms"), "fixed_false_alarms": demo.get("fixed_false_alarms"),
                      "shifts": demo.get("shifts"), "alibi": demo.get("alibi"), "evidently": demo.get("evidently"),
                      "transformer": results.get("transformer")}))


if __name__ == "__main__":
    main()
